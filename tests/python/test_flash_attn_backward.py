"""flash_attn's gradients (dq, dk, dv, dsinks, and through the lse) against float64 autograd of
the explicit reference, on the designed grid (every layout but the paged one, GQA, masks,
windows, varlen with empty sequences, seqused, sinks), every kernel path, gradcheck in float64,
and a compiled training step equal to eager."""

import pytest
import torch
from attention_reference import flash_attn_reference
from conftest import assert_raises_named
from flash_attn_cases import CASES, make_inputs

import opmesh

TRAINABLE = [c for c in CASES if c.layout_kv != "PA_BBND"]
# Gradients sum many products: float32 within 1e-4 of float64 relative to the largest entry;
# bf16/fp16 inputs are rounded, then computed in float32, and the gradients rounded once more.
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def gradients(q, k, v, kw, dout, dlse=None, fn=opmesh.flash_attn):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    sinks = kw.get("sinks")
    if sinks is not None:
        sinks = sinks.detach().clone().requires_grad_()
        leaves.append(sinks)
    call = {**kw, "sinks": sinks} if sinks is not None else kw
    out, lse = fn(*leaves[:3], return_softmax_lse=True, **call)
    loss = (out.double() * dout).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * dlse).sum()
    if not loss.requires_grad:  # the reference of a batch with no query rows: nothing to reach
        return [torch.zeros_like(x) for x in leaves]
    loss.backward()
    return [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]


def reference_gradients(q, k, v, kw, dout, dlse=None):
    def ref(q, k, v, return_softmax_lse, **kw):
        return flash_attn_reference(q.double(), k.double(), v.double(), **kw)

    kw = {**kw, "sinks": kw["sinks"].double()} if "sinks" in kw else kw
    return gradients(q.double(), k.double(), v.double(), kw, dout, dlse, fn=ref)


def assert_grads_close(got, want, dtype, what=""):
    for name, g, w in zip(("dq", "dk", "dv", "dsinks")[: len(got)], got, want, strict=True):
        assert g.shape == w.shape, f"{what} {name}: shape {g.shape}, want {w.shape}"
        if w.numel() == 0:
            continue
        scale = max(1.0, w.abs().max().item())
        err = (g.double() - w).abs().max().item()
        assert err <= TOL[dtype] * scale, f"{what} {name}: max error {err:.3g} (scale {scale:.3g})"


@pytest.fixture(params=["fused", "two_pass"])
def backward_mode(request, monkeypatch):
    """Runs a test with each of the backward's two schedules (one fused pass over (sequence,
    key head) units, or a key pass and a query pass)."""
    monkeypatch.setenv("OPMESH_BACKWARD", request.param)
    return request.param


@pytest.mark.parametrize("case", TRAINABLE, ids=lambda c: c.name)
def test_grid_float32(case, backward_mode):
    q, k, v, kw = make_inputs(case, torch.float32)
    gen = torch.Generator().manual_seed(1)
    out = opmesh.flash_attn(q, k, v, **kw)[0]
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = gradients(q, k, v, kw, dout)
    want = reference_gradients(q, k, v, kw, dout)
    assert_grads_close(got, want, torch.float32, case.name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["causal_more_keys", "sinks_window_tnd", "tnd_varlen_empty"])
def test_half_inputs(name, dtype, backward_mode):
    case = next(c for c in TRAINABLE if c.name == name)
    q, k, v, kw = make_inputs(case, dtype)
    out = opmesh.flash_attn(q, k, v, **kw)[0]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = gradients(q, k, v, kw, dout)
    assert all(g.dtype == dtype for g in got[:3])
    assert_grads_close(got, reference_gradients(q, k, v, kw, dout), dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_kernel_path_and_the_lse_gradient(simd_level, backward_mode, dtype):
    """bf16 inputs run on the level's bf16-pair kernels (products of bf16 operands, P and dS
    rounded to bf16) where the path has them, float32 FMA elsewhere."""
    case = next(c for c in TRAINABLE if c.name == "sinks_window_tnd")
    q, k, v, kw = make_inputs(case, dtype)
    out, lse = opmesh.flash_attn(q, k, v, return_softmax_lse=True, **kw)
    gen = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    got = gradients(q, k, v, kw, dout, dlse)
    assert_grads_close(got, reference_gradients(q, k, v, kw, dout, dlse), dtype)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 7, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 9, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=g, requires_grad=True)

    def f(q, k, v):
        # float64 inputs compute in float32: gradcheck's finite differences need the float64
        # view of a float32 computation to be smooth, which eps = 1e-3 gives.
        return opmesh.flash_attn(q, k, v, mask_mode=3, return_softmax_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-3, atol=2e-3, rtol=2e-3)
    s = lambda sinks: opmesh.flash_attn(  # noqa: E731
        q.detach().float(), k.detach().float(), v.detach().float(), sinks=sinks, mask_mode=3
    )[0].double()
    assert torch.autograd.gradcheck(s, (sinks,), eps=1e-2, atol=5e-3, rtol=5e-3)


def test_compiled_training_step_equals_eager():
    torch.manual_seed(5)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 3 * 32)
            self.sinks = torch.nn.Parameter(torch.zeros(4))

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 8).unbind(2)
            return opmesh.flash_attn(q, k, v, sinks=self.sinks, mask_mode=3)[0].sum(-1).sum(-1)

    x = torch.randn(2, 19, 32)
    eager, compiled = Block(), Block()
    compiled.load_state_dict(eager.state_dict())
    step = torch.compile(lambda m, x: m(x).square().mean(), fullgraph=True)
    eager(x).square().mean().backward()
    step(compiled, x).backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_results_do_not_depend_on_the_thread_count():
    case = next(c for c in TRAINABLE if c.name == "tnd_varlen_empty")
    q, k, v, kw = make_inputs(case, torch.float32)
    out = opmesh.flash_attn(q, k, v, **kw)[0]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gradients(q, k, v, kw, dout)
        torch.set_num_threads(max(2, threads))
        many = gradients(q, k, v, kw, dout)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))


def test_paged_keys_have_no_backward_and_say_so():
    case = next(c for c in CASES if c.layout_kv == "PA_BBND")
    q, k, v, kw = make_inputs(case, torch.float32)
    q.requires_grad_(True)
    out = opmesh.flash_attn(q, k, v, **kw)[0]
    assert_raises_named(ValueError, "layout_kv", lambda: out.sum().backward())


def test_backward_operator_checks_its_arguments():
    q = torch.randn(1, 5, 2, 8)
    k = torch.randn(1, 5, 1, 8)
    out, lse = opmesh.flash_attn(q, k, k, return_softmax_lse=True)
    op = torch.ops.opmesh.flash_attn_backward
    assert_raises_named(ValueError, "dout", lambda: op(out[:, :3], q, k, k, out, lse))
    assert_raises_named(TypeError, "dout", lambda: op(out.double(), q, k, k, out, lse))
    assert_raises_named(ValueError, "lse", lambda: op(out, q, k, k, out, lse[:, :1]))
    assert_raises_named(TypeError, "lse", lambda: op(out, q, k, k, out, lse.double()))


def _backward_call(case_name):
    case = next(c for c in TRAINABLE if c.name == case_name)
    q, k, v, kw = make_inputs(case, torch.float32)
    out, lse = opmesh.flash_attn(q, k, v, return_softmax_lse=True, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    plan_kw = {n: kw[n] for n in ("mask_mode", "win_left", "win_right") if n in kw}
    for n in ("cu_seqlens_q", "cu_seqlens_kv", "seqused_q", "seqused_kv"):
        if kw.get(n) is not None:
            plan_kw[n] = kw[n]
    layouts = {n: kw.get(n, "BSND") for n in ("layout_q", "layout_kv", "layout_out")}
    call_kw = {n: x for n, x in kw.items() if n not in ("max_seqlen_q", "max_seqlen_kv")}
    return q, k, v, out, lse, dout, call_kw, plan_kw, layouts


def _plan(q, k, v, plan_kw, layouts, **extra):
    tnd = layouts["layout_q"] == "TND"
    cu = plan_kw.get("cu_seqlens_q")
    batch = len(cu) - 1 if tnd else q.shape[0]
    seq_q = (
        int((cu[1:] - cu[:-1]).max()) if tnd else q.shape[1 if layouts["layout_q"] == "BSND" else 2]
    )
    cu_k = plan_kw.get("cu_seqlens_kv")
    seq_k = (
        int((cu_k[1:] - cu_k[:-1]).max())
        if tnd
        else k.shape[1 if layouts["layout_kv"] == "BSND" else 2]
    )
    heads_q = q.shape[-2] if layouts["layout_q"] != "BNSD" else q.shape[1]
    heads_k = k.shape[-2] if layouts["layout_kv"] != "BNSD" else k.shape[1]
    return opmesh.flash_attn_metadata(
        heads_q, heads_k, q.shape[-1], head_dim_v=v.shape[-1], batch_size=batch,
        max_seqlen_q=seq_q, max_seqlen_kv=seq_k, **plan_kw, **layouts, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["sinks_window_tnd", "tnd_varlen_empty"])
def test_a_backward_plan_gives_the_same_bits_for_any_worker_count(name, backward_mode):
    q, k, v, out, lse, dout, call_kw, plan_kw, layouts = _backward_call(name)
    backward = torch.ops.opmesh.flash_attn_backward
    unplanned = backward(dout, q, k, v, out, lse, **call_kw)
    for workers in (1, 3, 7, 64):
        plan = _plan(q, k, v, plan_kw, layouts, num_workers=workers, backward=True)
        info = opmesh.describe_metadata(plan)
        assert info["direction"] == "backward" and info["num_workers"] == workers
        assert info["fused"] == (backward_mode == "fused")
        assert len(info["worker_cost"]) == workers
        got = backward(dout, q, k, v, out, lse, metadata=plan, **call_kw)
        for a, b in zip(got, unplanned, strict=True):
            assert torch.equal(a, b), workers


def test_plans_are_refused_in_the_wrong_direction():
    q, k, v, out, lse, dout, call_kw, plan_kw, layouts = _backward_call("sinks_window_tnd")
    forward_plan = _plan(q, k, v, plan_kw, layouts, num_workers=2)
    backward_plan = _plan(q, k, v, plan_kw, layouts, num_workers=2, backward=True)
    err = assert_raises_named(
        ValueError,
        "metadata",
        lambda: torch.ops.opmesh.flash_attn_backward(
            dout, q, k, v, out, lse, metadata=forward_plan, **call_kw
        ),
    )
    assert "forward plan" in str(err)
    err = assert_raises_named(
        ValueError,
        "metadata",
        lambda: opmesh.flash_attn(q, k, v, metadata=backward_plan, **call_kw),
    )
    assert "backward plan" in str(err)
    old = backward_plan.clone()
    old[1] = 1  # a plan of format version 1
    err = assert_raises_named(
        ValueError,
        "metadata",
        lambda: torch.ops.opmesh.flash_attn_backward(
            dout, q, k, v, out, lse, metadata=old, **call_kw
        ),
    )
    assert "version 1" in str(err)


def test_a_backward_plan_for_other_lengths_is_refused():
    q, k, v, out, lse, dout, call_kw, plan_kw, layouts = _backward_call("tnd_varlen_empty")
    other = dict(plan_kw)
    cu = other["cu_seqlens_q"].clone()
    cu[-1] += 1  # one more query token in the last sequence
    other["cu_seqlens_q"] = cu
    plan = _plan(q, k, v, other, layouts, num_workers=2, backward=True)
    assert_raises_named(
        ValueError,
        "metadata",
        lambda: torch.ops.opmesh.flash_attn_backward(
            dout, q, k, v, out, lse, metadata=plan, **call_kw
        ),
    )


def test_a_paged_backward_plan_is_refused():
    assert_raises_named(
        ValueError,
        "layout_kv",
        lambda: opmesh.flash_attn_metadata(
            4,
            2,
            16,
            batch_size=1,
            max_seqlen_q=4,
            max_seqlen_kv=32,
            layout_kv="PA_BBND",
            backward=True,
        ),  # fmt: skip
    )
