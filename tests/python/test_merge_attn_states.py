"""merge_attn_states: attention over a key set split in two, merged, equals attention over the
whole set, in every layout, with rows empty in one or both parts; gradients by gradcheck and
through flash_attn; compiled equals eager; errors name the argument."""

import pytest
import torch
from conftest import assert_raises_named

import opmesh


def split_keys(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s1, s2, nq, nkv, d = 2, 19, 37, 4, 2, 16
    if layout == "TND":
        q = torch.randn(s1 * b, nq, d, generator=g)
        k = torch.randn(s2 * b, nkv, d, generator=g)
        v = torch.randn(s2 * b, nkv, d, generator=g)
    else:
        shape = (lambda s, n: (b, s, n, d)) if layout == "BSND" else (lambda s, n: (b, n, s, d))
        q = torch.randn(*shape(s1, nq), generator=g)
        k = torch.randn(*shape(s2, nkv), generator=g)
        v = torch.randn(*shape(s2, nkv), generator=g)
    return q, k, v


def attend(q, k, v, layout, **kw):
    lay = dict(layout_q=layout, layout_kv=layout, layout_out=layout)
    if layout == "TND":
        cu_q = torch.tensor([0, q.shape[0] // 2, q.shape[0]], dtype=torch.int32)
        cu_k = torch.tensor([0, k.shape[0] // 2, k.shape[0]], dtype=torch.int32)
        lay.update(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k)
    return opmesh.flash_attn(q, k, v, return_softmax_lse=True, **lay, **kw)


@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
def test_two_halves_merge_into_the_whole(layout):
    q, k, v = split_keys(layout)
    dim = 1 if layout == "BSND" else 2
    cut = 15
    whole = attend(q, k, v, layout)
    a = attend(q, k.narrow(dim, 0, cut), v.narrow(dim, 0, cut), layout)
    b = attend(
        q, k.narrow(dim, cut, k.shape[dim] - cut), v.narrow(dim, cut, k.shape[dim] - cut), layout
    )
    out, lse = opmesh.merge_attn_states(*a, *b, layout=layout)
    torch.testing.assert_close(out, whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, whole[1], rtol=1e-5, atol=1e-6)
    # The merge is symmetric.
    out2, lse2 = opmesh.merge_attn_states(*b, *a, layout=layout)
    torch.testing.assert_close(out2, out, rtol=1e-6, atol=1e-7)


def test_tnd_and_empty_rows():
    q, k, v = split_keys("BSND")
    # Batch entry 1 sees no key in part a (seqused_kv = 0): lse +inf, output 0 there.
    a = attend(q, k[:, :15], v[:, :15], "BSND", seqused_kv=torch.tensor([15, 0], dtype=torch.int32))
    b = attend(q, k[:, 15:], v[:, 15:], "BSND")
    assert torch.isposinf(a[1][1]).all()
    out, lse = opmesh.merge_attn_states(*a, *b)
    torch.testing.assert_close(out[1], b[0][1])
    torch.testing.assert_close(lse[1], b[1][1])
    # Empty in both: output 0, lse +inf.
    none = attend(
        q, k[:, :15], v[:, :15], "BSND", seqused_kv=torch.tensor([0, 0], dtype=torch.int32)
    )
    out, lse = opmesh.merge_attn_states(*none, *none)
    assert (out == 0).all() and torch.isposinf(lse).all()
    # TND: [T, N, Dv] with [N, T], one sequence whose keys are split at 30.
    qt, kt, vt = split_keys("TND")

    def one_sequence(keys, values):
        return opmesh.flash_attn(
            qt, keys, values, return_softmax_lse=True, layout_q="TND", layout_kv="TND",
            layout_out="TND", cu_seqlens_q=torch.tensor([0, qt.shape[0]], dtype=torch.int32),
            cu_seqlens_kv=torch.tensor([0, keys.shape[0]], dtype=torch.int32),
        )  # fmt: skip

    o1, l1 = one_sequence(kt[:30], vt[:30])
    o2, l2 = one_sequence(kt[30:], vt[30:])
    wo, wl = one_sequence(kt, vt)
    out, lse = opmesh.merge_attn_states(o1, l1, o2, l2, layout="TND")
    torch.testing.assert_close(out, wo, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, wl, rtol=1e-5, atol=1e-6)


def test_gradients():
    g = torch.Generator().manual_seed(3)
    out_a, out_b = (torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    lse_a, lse_b = (torch.randn(2, 3, 5, generator=g, dtype=torch.float64) for _ in range(2))
    # lse is float32 (as flash_attn returns it), so the lse inputs pass through a float32 cast:
    # finite differences with eps = 1e-3 see a smooth function at that precision.
    args = [x.requires_grad_() for x in (out_a, lse_a.float().double(), out_b, lse_b)]

    def f(oa, la, ob, lb):
        return opmesh.merge_attn_states(oa, la.float(), ob, lb.float())

    out, lse = f(*args)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    assert torch.autograd.gradcheck(f, tuple(args), eps=1e-3, atol=2e-3, rtol=2e-3)
    # Through flash_attn: the merged halves' gradients equal the whole call's.
    q, k, v = (x.requires_grad_() for x in split_keys("BSND"))
    a = attend(q, k[:, :15], v[:, :15], "BSND")
    b = attend(q, k[:, 15:], v[:, 15:], "BSND")
    merged, _ = opmesh.merge_attn_states(*a, *b)
    grads = torch.autograd.grad(merged.sum(), (q, k, v))
    whole, _ = attend(q, k, v, "BSND")
    want = torch.autograd.grad(whole.sum(), (q, k, v))
    for x, y in zip(grads, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_compiled_equals_eager():
    q, k, v = split_keys("BSND")
    a = attend(q, k[:, :15], v[:, :15], "BSND")
    b = attend(q, k[:, 15:], v[:, 15:], "BSND")
    want = opmesh.merge_attn_states(*a, *b)
    got = torch.compile(opmesh.merge_attn_states, fullgraph=True, dynamic=True)(*a, *b)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_errors_name_the_argument():
    q, k, v = split_keys("BSND")
    out, lse = attend(q, k, v, "BSND")
    assert_raises_named(
        ValueError, "layout", lambda: opmesh.merge_attn_states(out, lse, out, lse, layout="NHD")
    )
    assert_raises_named(
        ValueError, "out_b", lambda: opmesh.merge_attn_states(out, lse, out[:, :3], lse)
    )
    assert_raises_named(
        TypeError, "lse_b", lambda: opmesh.merge_attn_states(out, lse, out, lse.double())
    )
    assert_raises_named(
        ValueError, "lse_a", lambda: opmesh.merge_attn_states(out, lse[:, :1], out, lse)
    )
    assert_raises_named(
        ValueError, "out_a", lambda: opmesh.merge_attn_states(out[0], lse, out[0], lse)
    )
