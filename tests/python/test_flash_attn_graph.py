"""Graph mode for flash_attn_metadata and flash_attn: opcheck, fake tensors, and torch.compile
(fullgraph, static and dynamic shapes) equal to eager."""

import pytest
import torch
from flash_attn_cases import BY_NAME, make_inputs, metadata_kwargs

import opmesh

FLASH = torch.ops.opmesh.flash_attn.default
METADATA = torch.ops.opmesh.flash_attn_metadata.default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "name", ["causal_more_keys", "bnsd", "tnd_varlen_empty", "paged_16_decode", "sinks_causal"]
)
@pytest.mark.parametrize("planned", [False, True])
def test_opcheck_flash_attn(name, dtype, planned):
    case = BY_NAME[name]
    q, k, v, kw = make_inputs(case, dtype)
    if planned:
        kw["metadata"] = opmesh.flash_attn_metadata(
            case.nq, case.nkv, case.d, **metadata_kwargs(case, q, kw, num_workers=3)
        )
    torch.library.opcheck(FLASH, (q, k, v), dict(kw, return_softmax_lse=True))


@pytest.mark.parametrize("name", ["tnd_varlen_empty", "paged_64"])
def test_opcheck_metadata(name):
    case = BY_NAME[name]
    q, _, _, kw = make_inputs(case)
    torch.library.opcheck(
        METADATA, (case.nq, case.nkv, case.d), metadata_kwargs(case, q, kw, num_workers=5)
    )


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = BY_NAME["bnsd"]
    q, k, v, kw = make_inputs(case)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        out, lse = opmesh.flash_attn(fq, fk, fv, return_softmax_lse=True, **kw)
        md = opmesh.flash_attn_metadata(
            8, 2, 64, batch_size=2, max_seqlen_q=65, max_seqlen_kv=65, num_workers=7
        )
    assert out.shape == (2, 8, 65, 64) and lse.shape == (2, 8, 65)
    assert md.shape == (46 + 16 * 7,) and md.dtype == torch.int32


def varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k):
    md = opmesh.flash_attn_metadata(
        q.shape[1],
        k.shape[1],
        q.shape[2],
        head_dim_v=v.shape[2],
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_k,
        batch_size=cu_q.shape[0] - 1,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_k,
        mask_mode=3,
        layout_q="TND",
        layout_kv="TND",
        layout_out="TND",
        num_workers=4,
    )
    return opmesh.flash_attn(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_k,
        metadata=md,
        mask_mode=3,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_k,
        layout_q="TND",
        layout_kv="TND",
        layout_out="TND",
        return_softmax_lse=True,
    )


def dense_attention(q, k, v, sinks):
    md = opmesh.flash_attn_metadata(
        q.shape[2],
        k.shape[2],
        q.shape[3],
        batch_size=q.shape[0],
        max_seqlen_q=q.shape[1],
        max_seqlen_kv=k.shape[1],
        mask_mode=4,
        win_left=16,
        win_right=0,
    )
    out, lse = opmesh.flash_attn(
        q,
        k,
        v,
        sinks=sinks,
        metadata=md,
        mask_mode=4,
        win_left=16,
        win_right=0,
        return_softmax_lse=True,
    )
    return out, lse, out.float().sum(-1) + 1  # inside a larger graph


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_varlen_equals_eager(dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(varlen_attention, fullgraph=True, dynamic=dynamic)
    for name in ("tnd_varlen_empty", "tnd_dv", "window_sliding_tnd"):
        case = BY_NAME[name]
        q, k, v, kw = make_inputs(case, torch.bfloat16)
        args = (
            q,
            k,
            v,
            kw["cu_seqlens_q"],
            kw["cu_seqlens_kv"],
            max(case.q_lens),
            max(case.k_lens),
        )
        for got, want in zip(compiled(*args), varlen_attention(*args), strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_dense_with_new_shapes_equals_eager(dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(dense_attention, fullgraph=True, dynamic=dynamic)
    gen = torch.Generator().manual_seed(3)
    for s1, s2 in ((64, 64), (33, 100), (100, 33)):
        q = torch.randn(2, s1, 8, 64, generator=gen)
        k = torch.randn(2, s2, 2, 64, generator=gen)
        v = torch.randn(2, s2, 2, 64, generator=gen)
        sinks = torch.randn(8, generator=gen)
        got, want = compiled(q, k, v, sinks), dense_attention(q, k, v, sinks)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        torch.testing.assert_close(got[2], want[2])  # the surrounding ops may fuse differently
