"""Every operator with every tensor argument empty: batch 0, sequence 0 (queries, keys, or both,
BSND and TND), and heads that make zero rows. An empty tensor may have no buffer (a null data
pointer); wherever the result is defined the call returns it, forward and backward, matching the
float64 references (rows that see no key: output 0, lse +inf, the indexer's (-inf, 0))."""

import math

import pytest
import torch
from attention_reference import flash_attn_reference
from reference import indexer_softmax_lse, lightning_indexer

import opmesh

g = torch.Generator().manual_seed(7)


def rand(*shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64).float()


def cu(*lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


# (name, q shape, k shape, v shape, keyword arguments). Every case has at least one empty tensor.
_D, _DV = 16, 8
FLASH_CASES = [
    ("batch_0", (0, 5, 4, _D), (0, 7, 2, _D), (0, 7, 2, _DV), {}),
    ("queries_0", (2, 0, 4, _D), (2, 7, 2, _D), (2, 7, 2, _DV), {}),
    ("keys_0", (2, 5, 4, _D), (2, 0, 2, _D), (2, 0, 2, _DV), {}),
    ("keys_0_causal", (2, 5, 4, _D), (2, 0, 2, _D), (2, 0, 2, _DV), {"mask_mode": 3}),
    ("both_0", (2, 0, 4, _D), (2, 0, 2, _D), (2, 0, 2, _DV), {}),
    ("heads_0", (2, 5, 0, _D), (2, 7, 0, _D), (2, 7, 0, _DV), {}),
    (
        "bnsd_keys_0",
        (2, 4, 5, _D),
        (2, 2, 0, _D),
        (2, 2, 0, _DV),
        {"layout_q": "BNSD", "mask_mode": 3},
    ),
    (
        "tnd_tokens_q_0",
        (0, 4, _D),
        (9, 2, _D),
        (9, 2, _DV),
        {"layout_q": "TND", "cu_seqlens_q": cu(0, 0), "cu_seqlens_kv": cu(4, 5)},
    ),
    (
        "tnd_tokens_kv_0",
        (9, 4, _D),
        (0, 2, _D),
        (0, 2, _DV),
        {"layout_q": "TND", "cu_seqlens_q": cu(4, 5), "cu_seqlens_kv": cu(0, 0), "mask_mode": 3},
    ),
    (
        "tnd_batch_0",
        (0, 4, _D),
        (0, 2, _D),
        (0, 2, _DV),
        {"layout_q": "TND", "cu_seqlens_q": cu(), "cu_seqlens_kv": cu()},
    ),
    (
        "tnd_heads_0",
        (9, 0, _D),
        (9, 0, _D),
        (9, 0, _DV),
        {"layout_q": "TND", "cu_seqlens_q": cu(4, 5), "cu_seqlens_kv": cu(4, 5)},
    ),
]


def _reference_kwargs(kw):
    layout = kw.get("layout_q", "BSND")
    return dict(kw, layout_q=layout, layout_kv=layout, layout_out=layout)


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", FLASH_CASES, ids=[c[0] for c in FLASH_CASES])
def test_flash_attn_forward_and_backward(case, sinks):
    _, qs, ks, vs, kw = case
    q, k, v = (rand(*s).requires_grad_() for s in (qs, ks, vs))
    heads = qs[1] if kw.get("layout_q") in ("TND", "BNSD") else qs[2]
    if sinks:
        kw = dict(kw, sinks=rand(heads).requires_grad_())
    out, lse = opmesh.flash_attn(q, k, v, return_softmax_lse=True, **kw)

    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_kw = _reference_kwargs(kw)
    if sinks:
        ref_kw["sinks"] = kw["sinks"].detach().double().requires_grad_()
    ref_out, ref_lse = flash_attn_reference(*ref_inputs, **ref_kw)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)

    # Backward through the output and the finite part of the lse.
    w_out = rand(*out.shape)
    w_lse = rand(*lse.shape)
    finite = torch.isfinite(ref_lse)
    loss = (out * w_out).sum() + torch.where(finite, lse * w_lse, 0.0).sum()
    ref_loss = (ref_out * w_out.double()).sum()
    ref_loss = ref_loss + torch.where(finite, ref_lse, 0.0).mul(w_lse.double()).sum()
    leaves = [q, k, v] + ([kw["sinks"]] if sinks else [])
    ref_leaves = ref_inputs + ([ref_kw["sinks"]] if sinks else [])
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    # Where no element takes part, the reference's loss is a constant: every gradient is 0.
    ref_grads = (
        torch.autograd.grad(ref_loss, ref_leaves, allow_unused=True)
        if ref_loss.requires_grad
        else [None] * len(ref_leaves)
    )
    for name, got, want, leaf in zip("q k v sinks".split(), grads, ref_grads, leaves, strict=False):
        want = torch.zeros_like(leaf, dtype=torch.float64) if want is None else want
        got = torch.zeros_like(leaf) if got is None else got
        assert got.shape == leaf.shape, name
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=name)


def test_flash_attn_paged_keys_0():
    """A paged cache with sequences that hold no key yet (seqused_kv = 0), and a cache of no
    blocks at all."""
    q = rand(2, 3, 4, _D)
    for blocks in (0, 3):
        cache_k, cache_v = rand(blocks, 4, 2, _D), rand(blocks, 4, 2, _DV)
        table = torch.zeros(2, 1, dtype=torch.int32)
        lens = torch.zeros(2, dtype=torch.int32)
        out, lse = opmesh.flash_attn(
            q, cache_k, cache_v, block_table=table, seqused_kv=lens, return_softmax_lse=True
        )
        assert out.shape == (2, 3, 4, _DV) and not out.any()
        assert torch.isposinf(lse).all()


def test_flash_attn_metadata_and_plan_of_nothing():
    for batch, sq, skv in ((0, 4, 4), (2, 0, 4), (2, 4, 0)):
        plan = opmesh.flash_attn_metadata(
            4, 2, _D, batch_size=batch, max_seqlen_q=sq, max_seqlen_kv=skv, num_workers=3
        )
        assert opmesh.describe_metadata(plan)["num_workers"] == 3
        q, k, v = rand(batch, sq, 4, _D), rand(batch, skv, 2, _D), rand(batch, skv, 2, _D)
        out, lse = opmesh.flash_attn(q, k, v, metadata=plan, return_softmax_lse=True)
        assert out.shape == q.shape and not out.any() and torch.isposinf(lse).all()


INDEXER_CASES = [
    ("batch_0", (0, 5, 4, _D), (0, 7, 2, _D), {}),
    ("queries_0", (2, 0, 4, _D), (2, 7, 2, _D), {}),
    ("keys_0", (2, 5, 4, _D), (2, 0, 2, _D), {}),
    ("heads_0", (2, 5, 0, _D), (2, 7, 0, _D), {}),
    (
        "tnd_tokens_q_0",
        (0, 4, _D),
        (9, 2, _D),
        {"layout": "TND", "actual_seq_qlen": [0, 0], "actual_seq_klen": [4, 9]},
    ),
    (
        "tnd_tokens_k_0",
        (9, 4, _D),
        (0, 2, _D),
        {"layout": "TND", "actual_seq_qlen": [4, 9], "actual_seq_klen": [0, 0]},
    ),
]


def _indexer_inputs(qs, ks):
    qi, ki = rand(*qs), rand(*ks)
    w = rand(*qs[:-1]) / 4
    return qi, ki, w


@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("case", INDEXER_CASES, ids=[c[0] for c in INDEXER_CASES])
def test_indexer_softmax_lse(case, sparse_mode):
    _, qs, ks, kw = case
    qi, ki, w = _indexer_inputs(qs, ks)
    got = opmesh.dense_lightning_indexer_softmax_lse(qi, ki, w, sparse_mode=sparse_mode, **kw)
    want = indexer_softmax_lse(qi, ki, w, sparse_mode=sparse_mode, **kw)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def _lightning_kwargs(kw):
    renamed = {"layout": "layout_query", "actual_seq_qlen": "actual_seq_lengths_query"}
    renamed["actual_seq_klen"] = "actual_seq_lengths_key"
    out = {renamed[k]: v for k, v in kw.items()}
    out.setdefault("layout_query", "BSND")
    out["layout_key"] = out["layout_query"]
    return out


@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("case", INDEXER_CASES, ids=[c[0] for c in INDEXER_CASES])
def test_lightning_indexer(case, sparse_mode):
    _, qs, ks, kw = case
    qi, ki, w = _indexer_inputs(qs, ks)
    kw = _lightning_kwargs(kw)
    got = opmesh.lightning_indexer(
        qi, ki, w, sparse_count=3, sparse_mode=sparse_mode, return_value=True, **kw
    )
    want = lightning_indexer(qi, ki, w, sparse_count=3, sparse_mode=sparse_mode, **kw)
    rows = got[0] if kw["layout_query"] == "TND" else got[0].flatten(0, 1)
    assert got[0].shape == (*qs[:-2], ks[-2], 3) and got[1].shape == got[0].shape
    assert torch.equal(rows.long(), want[0])


def test_lightning_indexer_paged_with_no_keys():
    qi, w = rand(2, 3, 4, _D), rand(2, 3, 4)
    cache = rand(0, 16, 1, _D)
    table = torch.zeros(2, 0, dtype=torch.int32)
    indices, _ = opmesh.lightning_indexer(
        qi, cache, w, block_table=table, actual_seq_lengths_key=[0, 0], layout_key="PA_BSND",
        sparse_count=5,
    )  # fmt: skip
    assert indices.shape == (2, 3, 1, 5) and (indices == -1).all()


SPARSE_CASES = [
    ("batch_0", (0, 5, 4, _D), (0, 7, 2, _D), (0, 5, 2, 3), {}),
    ("queries_0", (2, 0, 4, _D), (2, 7, 2, _D), (2, 0, 2, 3), {}),
    ("keys_0", (2, 5, 4, _D), (2, 0, 2, _D), (2, 5, 2, 3), {}),
    ("heads_0", (2, 5, 0, _D), (2, 7, 0, _D), (2, 5, 0, 3), {}),
    ("k_0", (2, 5, 4, _D), (2, 7, 2, _D), (2, 5, 2, 0), {}),
    (
        "tnd_tokens_0",
        (0, 4, _D),
        (9, 2, _D),
        (0, 2, 3),
        {
            "layout_query": "TND",
            "layout_kv": "TND",
            "actual_seq_lengths_query": [0, 0],
            "actual_seq_lengths_kv": [4, 9],
        },
    ),
]


@pytest.mark.parametrize("case", SPARSE_CASES, ids=[c[0] for c in SPARSE_CASES])
def test_sparse_flash_attention_and_its_gradients(case):
    _, qs, ks, idx_shape, kw = case
    q, k, v = (rand(*s).requires_grad_(True) for s in (qs, ks, ks))
    idx = torch.full(idx_shape, -1, dtype=torch.int32)
    out, smax, ssum = opmesh.sparse_flash_attention(
        q, k, v, idx, 0.5, return_softmax_lse=True, **kw
    )
    assert out.shape == q.shape and not out.any()
    assert torch.isneginf(smax).all() and not ssum.any()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and not t.grad.any()


@pytest.mark.parametrize("case", INDEXER_CASES, ids=[c[0] for c in INDEXER_CASES])
def test_indexer_kl_loss_and_its_gradients(case):
    """The main attention has the indexer's shapes here (N1 query heads over N2 key heads); with
    nothing to compare, the loss is 0 and every gradient is 0 in its input's shape."""
    _, qs, ks, kw = case
    qi, ki, w = _indexer_inputs(qs, ks)
    query, key = rand(*qs), rand(*ks)
    n2 = ks[-2]
    group = qs[-2] // n2 if n2 else 0
    if kw.get("layout") == "TND":
        stats_shape = (n2, qs[0], group)
    else:
        stats_shape = (qs[0], n2, qs[1], group)
    smax, ssum = torch.zeros(stats_shape), torch.ones(stats_shape)
    imax, isum = opmesh.dense_lightning_indexer_softmax_lse(qi, ki, w, **kw)
    dqi, dki, dw, loss = opmesh.dense_lightning_indexer_grad_kl_loss(
        query, key, qi, ki, w, smax, ssum, imax, isum, 1 / math.sqrt(_D), **kw
    )
    assert dqi.shape == qi.shape and dki.shape == ki.shape and dw.shape == w.shape
    assert loss.shape == (1,) and loss.item() == 0.0
    for grad in (dqi, dki, dw):
        assert not grad.any()

    leaves = [x.clone().requires_grad_() for x in (qi, ki, w)]
    total = opmesh.indexer_kl_loss(*leaves, query, key, smax, ssum, 1 / math.sqrt(_D), **kw)
    total.sum().backward()
    for leaf in leaves:
        assert leaf.grad.shape == leaf.shape and not leaf.grad.any()

    # The sparse loss: a selection of K = 0 and one of K = 3 that lists no key.
    for k in (0, 3):
        idx = torch.full((*qs[:-2], ks[-2], k), -1, dtype=torch.int32)
        *grads, loss = opmesh.sparse_lightning_indexer_grad_kl_loss(
            query, key, qi, ki, w, idx, smax, ssum, 1 / math.sqrt(_D), **kw
        )
        assert loss.shape == (1,) and loss.item() == 0.0
        for grad, x in zip(grads, (qi, ki, w), strict=True):
            assert grad.shape == x.shape and not grad.any()
        leaves = [x.clone().requires_grad_() for x in (qi, ki, w)]
        total = opmesh.sparse_indexer_kl_loss(
            *leaves, query, key, idx, smax, ssum, 1 / math.sqrt(_D), **kw
        )
        total.sum().backward()
        for leaf in leaves:
            assert leaf.grad.shape == leaf.shape and not leaf.grad.any()


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "TND"])
@pytest.mark.parametrize("empty_dim", [0, 1, 2])
def test_merge_attn_states(layout, empty_dim):
    if layout == "TND":
        shape = [6, 3, _DV]
        lse_shape = lambda s: (s[1], s[0])  # noqa: E731
        if empty_dim == 2:
            pytest.skip("TND has two leading dims")
    elif layout == "BSND":
        shape = [2, 5, 3, _DV]
        lse_shape = lambda s: (s[0], s[2], s[1])  # noqa: E731
    else:
        shape = [2, 3, 5, _DV]
        lse_shape = lambda s: (s[0], s[1], s[2])  # noqa: E731
    shape[empty_dim] = 0
    leaves = [rand(*shape), rand(*lse_shape(shape)), rand(*shape), rand(*lse_shape(shape))]
    leaves = [x.requires_grad_() for x in leaves]
    out, lse = opmesh.merge_attn_states(*leaves, layout=layout)
    assert out.shape == tuple(shape) and lse.shape == lse_shape(shape)
    (out.sum() + lse.sum()).backward()
    for leaf in leaves:
        assert leaf.grad.shape == leaf.shape


def test_kv_cache_write_of_no_tokens():
    for blocks in (0, 2):
        key_cache, value_cache = rand(blocks, 4, 2, _D), rand(blocks, 4, 2, _DV)
        before = key_cache.clone(), value_cache.clone()
        no_slots = torch.zeros(0, dtype=torch.long)
        opmesh.kv_cache_write_(rand(0, 2, _D), rand(0, 2, _DV), key_cache, value_cache, no_slots)
        assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])
    # Tokens that are all skipped write nothing into an empty cache either.
    key_cache, value_cache = rand(0, 4, 2, _D), rand(0, 4, 2, _DV)
    opmesh.kv_cache_write_(rand(3, 2, _D), rand(3, 2, _DV), key_cache, value_cache, [-1, -1, -1])


def test_flash_attn_compiled_on_empty_keys():
    q, k, v = rand(2, 5, 4, _D), rand(2, 0, 2, _D), rand(2, 0, 2, _D)
    fn = torch.compile(lambda q, k, v: opmesh.flash_attn(q, k, v, return_softmax_lse=True))
    out, lse = fn(q, k, v)
    assert out.shape == q.shape and not out.any() and torch.isposinf(lse).all()


@pytest.mark.parametrize("side", ["main", "index"])
def test_kl_loss_with_no_heads_on_one_side(side):
    """0 heads on one side only: nothing to compare either, loss 0 and zero gradients."""
    b, s1, s2 = 2, 5, 7
    n1, n2, n1i, n2i = (0, 0, 4, 2) if side == "main" else (4, 2, 0, 0)
    qi, ki, w = rand(b, s1, n1i, _D), rand(b, s2, n2i, _D), rand(b, s1, n1i)
    query, key = rand(b, s1, n1, _D), rand(b, s2, n2, _D)
    group = n1 // n2 if n2 else 0
    smax, ssum = torch.zeros(b, n2, s1, group), torch.ones(b, n2, s1, group)
    imax, isum = opmesh.dense_lightning_indexer_softmax_lse(qi, ki, w)
    *grads, loss = opmesh.dense_lightning_indexer_grad_kl_loss(
        query, key, qi, ki, w, smax, ssum, imax, isum, 0.25
    )
    assert loss.item() == 0.0
    for grad, x in zip(grads, (qi, ki, w), strict=True):
        assert grad.shape == x.shape and not grad.any()
    idx = torch.tensor([0, 1], dtype=torch.int32).expand(b, s1, 1, 2)
    *grads, loss = opmesh.sparse_lightning_indexer_grad_kl_loss(
        query, key, qi, ki, w, idx, smax, ssum, 0.25
    )
    assert loss.item() == 0.0
    for grad, x in zip(grads, (qi, ki, w), strict=True):
        assert grad.shape == x.shape and not grad.any()
