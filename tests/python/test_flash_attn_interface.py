"""The flash-attn-style functions (opmesh.flash_attn_interface) against a float64 reference
written from flash-attn's documented semantics: fixed-length, varlen (packed and paged), the
kv-cache call with in-place append (dense and paged caches, cache_batch_idx), causal and windows,
GQA, lse, gradients, and the errors for features opmesh does not implement."""

import math

import pytest
import torch

from opmesh.flash_attn_interface import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)


def reference(q, k, v, causal=False, window=(-1, -1), scale=None):
    """One sequence, float64: q [Sq, H, D], k/v [Sk, Hk, D] -> out [Sq, H, Dv], lse [H, Sq]
    (rows without keys: out 0, lse +inf). Causal and windows aligned bottom-right."""
    q, k, v = q.double(), k.double(), v.double()
    sq, h, d = q.shape
    sk, hk = k.shape[:2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    k = k.repeat_interleave(h // hk, dim=1)
    v = v.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    diag = i + sk - sq
    left, right = window
    if causal:
        right = 0
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, torch.where(torch.isfinite(lse), lse, torch.inf)


def assert_close(got, want, what, tol=2e-5):
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: infinities differ"
    err = (got.double() - want)[finite].abs().max().item() if finite.any() else 0.0
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    assert err <= tol * max(1.0, scale), f"{what}: error {err:.2e}"


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


MASKS = [
    (False, (-1, -1)),
    (True, (-1, -1)),
    (False, (3, -1)),
    (False, (2, 1)),
    (True, (4, 7)),  # causal: the right side is 0
    (False, (0, 0)),
]
SHAPES = [(1, 1, 1), (3, 7, 7), (2, 17, 33), (2, 33, 17)]


@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("b,sq,sk", SHAPES)
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2)])
def test_flash_attn_func_matches_reference(causal, window, b, sq, sk, h, hk):
    q, k, v = randn(b, sq, h, 16, seed=1), randn(b, sk, hk, 16, seed=2), randn(b, sk, hk, 8, seed=3)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, return_softmax_lse=True)
    assert out.shape == (b, sq, h, 8) and lse.shape == (b, h, sq)
    for i in range(b):
        want_out, want_lse = reference(q[i], k[i], v[i], causal, window)
        assert_close(out[i], want_out, "out")
        assert_close(lse[i], want_lse, "lse")
    plain = flash_attn_func(q, k, v, causal=causal, window_size=window)
    assert torch.equal(plain, out)
    out3, lse3, probs = flash_attn_func(q, k, v, causal=causal, window_size=window,
                                        return_attn_probs=True)  # fmt: skip
    assert torch.equal(out3, out) and torch.equal(lse3, lse) and probs is None


def test_flash_attn_func_bf16_scale_and_gradients():
    q, k, v = (randn(2, 19, n, 32, seed=s) for s, n in ((1, 8), (2, 2), (3, 2)))
    want = [reference(q[i], k[i], v[i], True, (-1, -1), 0.3)[0] for i in range(2)]
    got = flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), softmax_scale=0.3, causal=True)
    assert got.dtype == torch.bfloat16
    for i in range(2):
        assert_close(got[i].float(), want[i], "bf16 out", tol=2e-2)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    dout = randn(2, 19, 8, 32, seed=4)
    flash_attn_func(*ours, causal=True, window_size=(5, -1)).mul(dout).sum().backward()
    ref = torch.stack([reference(*(x[i] for x in leaves), True, (5, -1))[0] for i in range(2)])
    ref.mul(dout.double()).sum().backward()
    for name, a, b_ in zip("qkv", ours, leaves, strict=True):
        assert_close(a.grad, b_.grad, f"d{name}", tol=1e-4)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("causal,window", MASKS[:4])
@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_varlen_func_matches_reference(causal, window, paged):
    q_lens, k_lens = [5, 0, 13, 1, 9], [5, 3, 20, 0, 12]
    h, hk = 8, 2
    q = randn(sum(q_lens), h, 16, seed=1)
    k, v = randn(sum(k_lens), hk, 16, seed=2), randn(sum(k_lens), hk, 16, seed=3)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    if paged:
        # The same keys in a paged cache: blocks of 4 slots, each sequence's blocks shuffled.
        block, per_seq = 4, 5
        table = torch.randperm(len(q_lens) * per_seq, generator=torch.Generator().manual_seed(5))
        table = table.view(len(q_lens), per_seq).to(torch.int32)
        k_cache = torch.zeros(len(q_lens) * per_seq, block, hk, 16)
        v_cache = torch.zeros_like(k_cache)
        for b, n in enumerate(k_lens):
            for j in range(n):
                k_cache[table[b, j // block], j % block] = k[cu_k[b] + j]
                v_cache[table[b, j // block], j % block] = v[cu_k[b] + j]
        out, lse = flash_attn_varlen_func(
            q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal,
            window_size=window, block_table=table, return_softmax_lse=True,
        )  # fmt: skip
    else:
        out, lse = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k.long(), max(q_lens), max(k_lens), causal=causal,
            window_size=window, return_softmax_lse=True,
        )  # fmt: skip
    assert out.shape == q.shape and lse.shape == (h, sum(q_lens))
    for b in range(len(q_lens)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        want_out, want_lse = reference(q[rows], k[keys], v[keys], causal, window)
        assert_close(out[rows], want_out, f"out of sequence {b}")
        assert_close(lse[:, rows], want_lse, f"lse of sequence {b}")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_with_kvcache_appends_in_place_and_attends(paged, causal):
    b, h, hk, d, new = 3, 4, 2, 16, 2
    lengths = torch.tensor([5, 0, 9], dtype=torch.int32)
    history_k, history_v = randn(b, 12, hk, d, seed=1), randn(b, 12, hk, d, seed=2)
    k_new, v_new = randn(b, new, hk, d, seed=3), randn(b, new, hk, d, seed=4)
    q = randn(b, new, h, d, seed=5)
    if paged:
        block = 4
        table = torch.tensor([[5, 0, 2, 7], [1, 3, 4, 6], [8, 9, 10, 11]], dtype=torch.int32)
        k_cache = torch.zeros(12, block, hk, d)
        v_cache = torch.zeros_like(k_cache)
        for s in range(b):
            for j in range(int(lengths[s])):
                k_cache[table[s, j // block], j % block] = history_k[s, j]
                v_cache[table[s, j // block], j % block] = history_v[s, j]
        extra = dict(block_table=table)
    else:
        # Dense cache rows in another order: sequence s lives in row index[s].
        index = torch.tensor([2, 0, 1])
        k_cache, v_cache = torch.zeros(3, 16, hk, d), torch.zeros(3, 16, hk, d)
        for s in range(b):
            k_cache[index[s], : lengths[s]] = history_k[s, : lengths[s]]
            v_cache[index[s], : lengths[s]] = history_v[s, : lengths[s]]
        extra = dict(cache_batch_idx=index)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=causal,
        return_softmax_lse=True, **extra,
    )  # fmt: skip
    for s in range(b):
        n = int(lengths[s])
        keys = torch.cat([history_k[s, :n], k_new[s]])
        values = torch.cat([history_v[s, :n], v_new[s]])
        want_out, want_lse = reference(q[s], keys, values, causal)
        assert_close(out[s], want_out, f"out of sequence {s}")
        assert_close(lse[s], want_lse, f"lse of sequence {s}")
        for j in range(new):  # the new tokens were written into the cache
            if paged:
                slot = (table[s, (n + j) // 4], (n + j) % 4)
            else:
                slot = (index[s], n + j)
            assert torch.equal(k_cache[slot], k_new[s, j]) and torch.equal(
                v_cache[slot], v_new[s, j]
            )


def test_flash_attn_with_kvcache_decode_loop_matches_one_call():
    """Appending one token per step equals attending to the whole sequence causally."""
    b, h, hk, d, steps = 2, 4, 1, 16, 6
    k_all, v_all, q_all = (
        randn(b, steps, hk, d, seed=1),
        randn(b, steps, hk, d, seed=2),
        randn(b, steps, h, d, seed=3),
    )
    k_cache, v_cache = torch.zeros(b, 8, hk, d), torch.zeros(b, 8, hk, d)
    outs = []
    for t in range(steps):
        outs.append(
            flash_attn_with_kvcache(
                q_all[:, t : t + 1],
                k_cache,
                v_cache,
                k_all[:, t : t + 1],
                v_all[:, t : t + 1],
                cache_seqlens=t,
                causal=True,
            )  # fmt: skip
        )
    whole = flash_attn_func(q_all, k_all, v_all, causal=True)
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "call,argument",
    [
        (lambda q: flash_attn_func(q, q, q, dropout_p=0.1), "dropout_p"),
        (
            lambda q: flash_attn_varlen_func(
                q[0], q[0], q[0], _cu([3]), _cu([3]), 3, 3, dropout_p=0.5
            ),
            "dropout_p",
        ),  # fmt: skip
        (
            lambda q: flash_attn_with_kvcache(q, q, q, rotary_cos=torch.ones(3, 4)),
            "rotary_cos",
        ),
        (
            lambda q: flash_attn_with_kvcache(q, q, q, cache_leftpad=torch.zeros(1)),
            "cache_leftpad",
        ),
    ],
)
def test_unsupported_features_are_named(call, argument):
    q = randn(1, 3, 2, 8)
    with pytest.raises(NotImplementedError, match=f"^{argument}: "):
        call(q)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(window_size=(1,)), "window_size"),
        (dict(window_size=(-2, 0)), "window_size"),
    ],
)
def test_bad_windows_are_named(kwargs, argument):
    q = randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match=f"^{argument}: "):
        flash_attn_func(q, q, q, **kwargs)


def test_paged_varlen_without_key_lengths_is_named():
    q, cache = randn(3, 2, 8), torch.zeros(2, 4, 2, 8)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="^seqused_k: a paged cache needs"):
        flash_attn_varlen_func(q, cache, cache, _cu([3]), None, block_table=table)


def test_kvcache_errors_are_named():
    q, cache = randn(2, 1, 2, 8), torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="^k: k and v are appended together"):
        flash_attn_with_kvcache(q, cache, cache.clone(), k=q[:, :, :2], cache_seqlens=1)
    with pytest.raises(ValueError, match="^k: appending 3 tokens"):
        flash_attn_with_kvcache(
            q, cache, cache.clone(), randn(2, 3, 2, 8), randn(2, 3, 2, 8), cache_seqlens=2
        )
    with pytest.raises(ValueError, match="^cache_batch_idx: expected 2 entries"):
        flash_attn_with_kvcache(q, cache, cache.clone(), cache_batch_idx=torch.tensor([0]))


# -- opmesh.flash_attn's own defaults ------------------------------------------------------------


def test_layouts_follow_q_and_a_block_table_implies_paged():
    import opmesh

    q, k, v = randn(2, 4, 9, 16, seed=1), randn(2, 2, 9, 16, seed=2), randn(2, 2, 9, 16, seed=3)
    out, _ = opmesh.flash_attn(q, k, v, layout_q="BNSD", mask_mode=3)
    assert out.shape == (2, 4, 9, 16)  # BNSD out, as q
    explicit, _ = opmesh.flash_attn(
        q, k, v, layout_q="BNSD", layout_kv="BNSD", layout_out="BNSD", mask_mode=3
    )
    assert torch.equal(out, explicit)
    cache_k = k.transpose(1, 2).reshape(2, 9, 2, 16)  # [blocks=2, block_size=9, Nkv, D]
    cache_v = v.transpose(1, 2).reshape(2, 9, 2, 16)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    paged, _ = opmesh.flash_attn(
        q.transpose(1, 2), cache_k, cache_v, block_table=table, seqused_kv=[9, 9], mask_mode=3
    )
    torch.testing.assert_close(paged, out.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_int64_lengths_are_taken_and_out_of_range_refused():
    import opmesh

    q = randn(12, 2, 8)
    cu = torch.tensor([0, 5, 12])
    assert cu.dtype == torch.int64
    a, _ = opmesh.flash_attn(q, q, q, layout_q="TND", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    b, _ = opmesh.flash_attn(q, q, q, layout_q="TND", cu_seqlens_q=cu.int(), cu_seqlens_kv=cu.int())
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="^cu_seqlens_kv: entry 4294967308 is outside the int32"):
        opmesh.flash_attn(
            q, q, q, layout_q="TND", cu_seqlens_q=cu, cu_seqlens_kv=cu + torch.tensor([0, 0, 2**32])
        )


def test_varlen_gradients_match_reference():
    q_lens, k_lens = [4, 0, 9], [6, 2, 9]
    q, k, v = randn(13, 4, 16, seed=1), randn(17, 2, 16, seed=2), randn(17, 2, 16, seed=3)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    dout = randn(13, 4, 16, seed=4)
    flash_attn_varlen_func(*ours, cu_q, cu_k, causal=True).mul(dout).sum().backward()
    outs = []
    for b in range(3):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        outs.append(reference(leaves[0][rows], leaves[1][keys], leaves[2][keys], True)[0])
    torch.cat(outs).mul(dout.double()).sum().backward()
    for name, a, b_ in zip("qkv", ours, leaves, strict=True):
        assert_close(a.grad, b_.grad, f"d{name}", tol=1e-4)


def test_compiles_with_fullgraph():
    q, k, v = randn(2, 33, 8, 32, seed=1), randn(2, 33, 2, 32, seed=2), randn(2, 33, 2, 32, seed=3)

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(8, 0))

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v), rtol=1e-6, atol=1e-6)


def test_varlen_paged_with_seqused_k_only():
    cu_q = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    table = torch.arange(9, dtype=torch.int32).view(3, 3)
    k_cache, v_cache = randn(9, 4, 2, 32, seed=1), randn(9, 4, 2, 32, seed=2)
    used = torch.tensor([5, 0, 12], dtype=torch.int32)
    q = randn(7, 8, 32, seed=3)
    got = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, None, block_table=table, seqused_k=used, causal=True
    )
    for b, (start, end) in enumerate([(0, 3), (3, 3), (3, 7)]):
        n = int(used[b])
        keys = torch.cat([k_cache[table[b, j // 4], j % 4].unsqueeze(0) for j in range(n)] or
                         [torch.zeros(0, 2, 32)])  # fmt: skip
        values = torch.cat([v_cache[table[b, j // 4], j % 4].unsqueeze(0) for j in range(n)] or
                           [torch.zeros(0, 2, 32)])  # fmt: skip
        want, _ = reference(q[start:end], keys, values, True)
        assert_close(got[start:end], want, f"sequence {b}")


def test_deterministic_and_the_thread_count():
    """What the docs say of `deterministic`: it changes nothing, and a call gives the same bits
    every time on one thread count, forward and backward; on a deterministic plan the forward and
    its gradients are the same bits on any thread count (a window over 65 keys whose units the
    default plan splits on 2 threads)."""
    import opmesh

    q, k, v = randn(3, 17, 1, 8, seed=1), randn(3, 65, 1, 8, seed=2), randn(3, 65, 1, 24, seed=3)
    up = randn(3, 17, 1, 24, seed=4)

    def gradients(call):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = call(*leaves)
        out.backward(up)
        return [out.detach()] + [t.grad for t in leaves]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    threads = torch.get_num_threads()
    planned = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            first = gradients(
                lambda *t: flash_attn_func(*t, window_size=(-1, 2), deterministic=True)
            )
            again = gradients(lambda *t: flash_attn_func(*t, window_size=(-1, 2)))
            assert same(first, again)
            plan = opmesh.flash_attn_metadata(
                1, 1, 8, head_dim_v=24, batch_size=3, max_seqlen_q=17, max_seqlen_kv=65,
                mask_mode=4, win_left=-1, win_right=2, deterministic=True,
            )  # fmt: skip
            planned.append(
                gradients(
                    lambda *t, p=plan: opmesh.flash_attn(*t, metadata=p, mask_mode=4, win_right=2)[
                        0
                    ]
                )  # fmt: skip
            )
    finally:
        torch.set_num_threads(threads)
    assert same(planned[0], planned[1]) and same(planned[0], planned[2])
