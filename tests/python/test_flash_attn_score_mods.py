"""flash_attn's softcap and ALiBi (flash-attn's semantics) against the float64 reference: the
output, the lse and the gradients, on a grid of layouts and masks (more keys than queries, more
queries than keys, windows, varlen TND with empty sequences, paged decode, odd head dims), slopes
per head and per (batch, head), float32 and bf16, both backward schedules and every kernel path;
the flash-attn interface functions; the refusals."""

import pytest
import torch
from attention_reference import flash_attn_reference
from conftest import assert_raises_named
from flash_attn_cases import BY_NAME, TOLERANCES, make_inputs
from test_flash_attn_backward import TOL, assert_grads_close, gradients, reference_gradients

import opmesh
from opmesh.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

NAMES = [
    "causal_more_keys",
    "causal_more_queries",
    "bnsd",
    "sinks_window_tnd",
    "tnd_varlen_empty",
    "odd_dims",
    "paged_tnd",
]


def slopes_for(case, per_batch, nq):
    g = torch.Generator().manual_seed(7)
    shape = (len(case.q_lens), nq) if per_batch else (nq,)
    return torch.rand(shape, generator=g) * 0.5


def with_mods(case, dtype, variant):
    q, k, v, kw = make_inputs(case, dtype)
    nq = q.shape[1] if case.layout_q in ("TND", "BNSD") else q.shape[2]
    if variant in ("softcap", "both"):
        kw["softcap"] = 1.5
    if variant in ("alibi", "both", "alibi_batch"):
        kw["alibi_slopes"] = slopes_for(case, variant == "alibi_batch", nq)
    if variant == "strided":
        # Slopes and sinks as strided views (every other column): the kernel reads copies it
        # keeps alive for the whole call.
        wide = slopes_for(case, True, 2 * nq)
        kw["alibi_slopes"] = wide[:, ::2]
        if kw.get("sinks") is not None:
            kw["sinks"] = torch.stack([kw["sinks"], kw["sinks"] + 1], dim=1)[:, 0]
        assert not kw["alibi_slopes"].is_contiguous()
    return q, k, v, kw


VARIANTS = ["softcap", "alibi", "alibi_batch", "both", "strided"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_forward(name, dtype, variant):
    q, k, v, kw = with_mods(BY_NAME[name], dtype, variant)
    out, lse = opmesh.flash_attn(q, k, v, return_softmax_lse=True, **kw)
    want_out, want_lse = flash_attn_reference(q, k, v, **kw)
    out_atol, out_rtol, lse_atol, lse_rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), want_out, atol=out_atol, rtol=out_rtol)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-4, rtol=lse_rtol)


@pytest.mark.parametrize("backward_mode", ["fused", "two_pass"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", [n for n in NAMES if n != "paged_tnd"])
def test_gradients(name, dtype, variant, backward_mode, monkeypatch):
    monkeypatch.setenv("OPMESH_BACKWARD", backward_mode)
    q, k, v, kw = with_mods(BY_NAME[name], dtype, variant)
    out = opmesh.flash_attn(q, k, v, **kw)[0]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = gradients(q, k, v, kw, dout)
    assert_grads_close(got, reference_gradients(q, k, v, kw, dout), dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_kernel_path(simd_level, dtype):
    q, k, v, kw = with_mods(BY_NAME["sinks_window_tnd"], dtype, "both")
    out, lse = opmesh.flash_attn(q, k, v, return_softmax_lse=True, **kw)
    want_out, _ = flash_attn_reference(q, k, v, **kw)
    torch.testing.assert_close(out.double(), want_out, atol=TOL[dtype], rtol=TOL[dtype])
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = gradients(q, k, v, kw, dout)
    assert_grads_close(got, reference_gradients(q, k, v, kw, dout), dtype)


def test_softcap_bounds_the_scores():
    # Huge scores stay within +-softcap: the rows' softmax is the one of the capped scores.
    q = torch.full((1, 1, 1, 4), 100.0)
    k = torch.tensor([[[[1.0] * 4]], [[[-1.0] * 4]]]).view(1, 2, 1, 4)
    v = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)
    out = opmesh.flash_attn(q, k, v, softcap=2.0)[0]
    p = torch.softmax(torch.tensor([2.0, -2.0]), 0)
    torch.testing.assert_close(out.flatten(), p[:1])


def test_flash_attn_interface_functions():
    case = BY_NAME["tnd_varlen_empty"]
    q, k, v, kw = with_mods(case, torch.float32, "alibi_batch")
    cu = kw["cu_seqlens_q"]
    got = flash_attn_varlen_func(
        q, k, v, cu, kw["cu_seqlens_kv"], causal=kw.get("mask_mode") == 3, softcap=1.5,
        alibi_slopes=kw["alibi_slopes"],
    )  # fmt: skip
    want = opmesh.flash_attn(q, k, v, **{**kw, "softcap": 1.5})[0]
    torch.testing.assert_close(got, want)
    g = torch.Generator().manual_seed(1)
    qb, kb, vb = (torch.randn(2, 9, 4, 16, generator=g) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    got = flash_attn_func(qb, kb, vb, causal=True, softcap=3.0, alibi_slopes=slopes)
    want = opmesh.flash_attn(qb, kb, vb, mask_mode=3, softcap=3.0, alibi_slopes=slopes)[0]
    torch.testing.assert_close(got, want)


def test_refusals():
    q = torch.randn(2, 5, 4, 8)
    k = v = torch.randn(2, 5, 2, 8)
    call = opmesh.flash_attn
    assert_raises_named(ValueError, "softcap", lambda: call(q, k, v, softcap=-1.0))
    assert_raises_named(ValueError, "softcap", lambda: call(q, k, v, softcap=float("inf")))
    assert_raises_named(ValueError, "softcap", lambda: call(q, k, v, softcap=float("nan")))
    for bad in (torch.zeros(3), torch.zeros(3, 4), torch.zeros(2, 4, 1)):
        assert_raises_named(
            ValueError, "alibi_slopes", lambda bad=bad: call(q, k, v, alibi_slopes=bad)
        )
    assert_raises_named(
        TypeError, "alibi_slopes", lambda: call(q, k, v, alibi_slopes=torch.zeros(4).double())
    )
    nan = torch.tensor([0.5, float("nan"), 0.1, 0.1])
    assert_raises_named(ValueError, "alibi_slopes", lambda: call(q, k, v, alibi_slopes=nan))
    trainable = torch.zeros(4, requires_grad=True)
    assert_raises_named(ValueError, "alibi_slopes", lambda: call(q, k, v, alibi_slopes=trainable))
    with torch.no_grad():
        call(q, k, v, alibi_slopes=trainable)  # no gradient asked: nothing dropped


@pytest.mark.parametrize("softcap", [20.0, 1e3, 1e6])
def test_a_large_softcap_is_exact_where_it_barely_caps(simd_level, softcap):
    """Scores far below the cap: s / softcap is tiny, where tanh's exponential form cancels, and
    the cap multiplies any error back up. Forward and gradients against float64, every kernel
    path."""
    q, k, v, kw = make_inputs(BY_NAME["sinks_window_tnd"], torch.float32)
    kw["softcap"] = softcap
    out, lse = opmesh.flash_attn(q, k, v, return_softmax_lse=True, **kw)
    want_out, want_lse = flash_attn_reference(q, k, v, **kw)
    torch.testing.assert_close(out.double(), want_out, atol=TOL[torch.float32], rtol=1e-5)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-5, rtol=1e-5)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = gradients(q, k, v, kw, dout)
    assert_grads_close(got, reference_gradients(q, k, v, kw, dout), torch.float32)
