"""opmesh on MindSpore tensors: every operator against the torch binding on the same inputs
(bitwise: the same core kernels on the same plan), gradients through MindSpore's autograd and a
user-written DFunction on both frameworks, and errors."""

import os
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
import torch

import opmesh

RNG = np.random.default_rng(0)


def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def both(array, dtype="float32"):
    """The same values as a MindSpore and a torch tensor of `dtype` (bf16 rounds alike)."""
    t = torch.from_numpy(array).to(getattr(torch, dtype))
    m = ms.Tensor(t.float().numpy()).astype(getattr(ms, dtype))
    return m, t


def as_numpy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().float().numpy()
    return x.float().asnumpy() if x.dtype == ms.bfloat16 else x.asnumpy()


def assert_same(m, t):
    assert tuple(m.shape) == tuple(t.shape)
    np.testing.assert_array_equal(as_numpy(m), as_numpy(t))


# ----------------------------------------------------------------------------------- indexer


INDEXER_CASES = [
    # (layout, sparse_mode, qlens, klens, band)
    ("BSND", 3, None, None, None),
    ("BSND", 0, None, None, None),
    ("BSND", 3, [13, 0, 7], [17, 5, 0], None),
    ("BSND", 3, None, None, (5, 0)),
    ("TND", 3, [4, 4, 11], [6, 6, 19], None),
    ("TND", 0, [0, 9, 13], [3, 3, 17], None),
]


def indexer_inputs(layout, dtype, qlens, klens, n1=8, n2=2, d=32):
    if layout == "BSND":
        q, k, w = randn(3, 13, n1, d), randn(3, 17, n2, d), randn(3, 13, n1, scale=0.2)
    else:
        q, k, w = randn(qlens[-1], n1, d), randn(klens[-1], n2, d), randn(qlens[-1], n1, scale=0.2)
    return both(q, dtype), both(k, dtype), both(w, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", INDEXER_CASES, ids=lambda c: f"{c[0]}-m{c[1]}-{c[2]}-{c[4]}")
def test_indexer_matches_torch(case, dtype):
    layout, mode, qlens, klens, band = case
    (mq, tq), (mk, tk), (mw, tw) = indexer_inputs(layout, dtype, qlens, klens)
    kw = dict(layout=layout, sparse_mode=mode, actual_seq_qlen=qlens, actual_seq_klen=klens)
    if band:
        kw.update(pre_tokens=band[0], next_tokens=band[1])
    m_max, m_sum = opmesh.dense_lightning_indexer_softmax_lse(mq, mk, mw, **kw)
    t_max, t_sum = opmesh.dense_lightning_indexer_softmax_lse(tq, tk, tw, **kw)
    assert isinstance(m_max, ms.Tensor)
    assert_same(m_max, t_max)
    assert_same(m_sum, t_sum)


def test_indexer_over_compressed_keys_matches_torch():
    # 13 queries over 17 entries of 2 original tokens (residual 1 or 0): the compressed mask.
    (mq, tq), (mk, tk), (mw, tw) = indexer_inputs("BSND", "float32", None, None)
    kw = dict(cmp_ratio=2, cmp_residual_key=[1, 0, 1])
    m = opmesh.dense_lightning_indexer_softmax_lse(mq, mk, mw, **kw)
    t = opmesh.dense_lightning_indexer_softmax_lse(tq, tk, tw, **kw)
    plain = opmesh.dense_lightning_indexer_softmax_lse(tq, tk, tw)
    assert not torch.equal(t[1], plain[1])  # the compression reached the kernel
    assert_same(m[0], t[0])
    assert_same(m[1], t[1])


def test_indexer_lengths_as_mindspore_tensors():
    (mq, tq), (mk, tk), (mw, tw) = indexer_inputs("BSND", "float32", None, None)
    lens = np.array([3, 13, 0], np.int64)
    m = opmesh.dense_lightning_indexer_softmax_lse(mq, mk, mw, actual_seq_qlen=ms.Tensor(lens))
    t = opmesh.dense_lightning_indexer_softmax_lse(tq, tk, tw, actual_seq_qlen=torch.tensor(lens))
    assert_same(m[0], t[0])
    assert_same(m[1], t[1])


LIGHTNING_CASES = [
    # (layout_query, layout_key, sparse_mode, qlens, klens, band)
    ("BSND", "BSND", 3, None, None, None),
    ("BSND", "BSND", 0, [13, 0, 7], [17, 5, 0], (4, 2)),
    ("TND", "TND", 3, [4, 4, 11], [6, 6, 19], None),
    ("BSND", "PA_BSND", 3, None, [17, 1, 9], None),
    ("TND", "PA_BSND", 3, [1, 3, 5], [17, 1, 9], None),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", LIGHTNING_CASES, ids=lambda c: f"{c[0]}-{c[1]}-m{c[2]}")
def test_lightning_indexer_matches_torch(case, dtype):
    layout_query, layout_key, mode, qlens, klens, band = case
    n1, n2, d = 8, 2, 32
    if layout_key == "PA_BSND":
        lead = (3, 13) if layout_query == "BSND" else (qlens[-1],)
        keys = randn(9, 4, n2, d)  # 9 blocks of 4: enough for 17 + 1 + 9 keys
        table = [[0, 1, 2, 3, 4], [5, 0, 0, 0, 0], [6, 7, 8, 0, 0]]
        kw = dict(block_table=table, actual_seq_lengths_key=klens)
    elif layout_query == "BSND":
        lead, keys = (3, 13), randn(3, 17, n2, d)
        kw = dict(actual_seq_lengths_key=klens)
    else:
        lead, keys = (qlens[-1],), randn(klens[-1], n2, d)
        kw = dict(actual_seq_lengths_key=klens)
    (mq, tq), (mk, tk), (mw, tw) = (
        both(randn(*lead, n1, d), dtype),
        both(keys, dtype),
        both(randn(*lead, n1, scale=0.2), "float32"),
    )
    kw.update(
        actual_seq_lengths_query=qlens,
        layout_query=layout_query,
        layout_key=layout_key,
        sparse_mode=mode,
        sparse_count=6,
        return_value=True,
    )
    if band:
        kw.update(pre_tokens=band[0], next_tokens=band[1])
    m_idx, m_val = opmesh.lightning_indexer(mq, mk, mw, **kw)
    t_idx, t_val = opmesh.lightning_indexer(tq, tk, tw, **kw)
    assert isinstance(m_idx, ms.Tensor) and m_idx.dtype == ms.int32
    assert_same(m_idx, t_idx)
    assert_same(m_val, t_val)
    assert (as_numpy(t_idx) >= 0).any()
    # An option reaches the binding's kernel by its declared name alone.
    m_scaled = opmesh.lightning_indexer(mq, mk, mw, **kw, scale_value=0.25)[1]
    t_scaled = opmesh.lightning_indexer(tq, tk, tw, **kw, scale_value=0.25)[1]
    assert_same(m_scaled, t_scaled)
    assert not np.array_equal(as_numpy(m_scaled), as_numpy(m_val))
    if mode == 3 and not band:
        # Compressed keys: the ratio by its declared name, the residuals as host lengths.
        # With every visible key selected, the compressed mask shows in how many there are.
        kw.update(sparse_count=32)
        every = opmesh.lightning_indexer(mq, mk, mw, **kw)[0]
        batch = len(klens) if klens else lead[0]
        kw.update(cmp_ratio=3, cmp_residual_key=[(2 * b + 1) % 3 for b in range(batch)])
        m_cmp = opmesh.lightning_indexer(mq, mk, mw, **kw)[0]
        t_cmp = opmesh.lightning_indexer(tq, tk, tw, **kw)[0]
        assert_same(m_cmp, t_cmp)
        assert (as_numpy(m_cmp) >= 0).sum() != (as_numpy(every) >= 0).sum()


def test_lightning_indexer_block_table_as_a_mindspore_tensor_and_no_values():
    (mq, tq), (mk, tk), (mw, tw) = (
        both(randn(2, 3, 4, 16)),
        both(randn(6, 8, 1, 16)),
        both(randn(2, 3, 4)),
    )
    table = np.array([[4, 2], [1, 0]], np.int32)
    kw = dict(actual_seq_lengths_key=[11, 16], layout_key="PA_BSND", sparse_count=5)
    m_idx, m_val = opmesh.lightning_indexer(mq, mk, mw, block_table=ms.Tensor(table), **kw)
    t_idx, t_val = opmesh.lightning_indexer(tq, tk, tw, block_table=torch.from_numpy(table), **kw)
    assert_same(m_idx, t_idx)
    assert tuple(m_val.shape) == tuple(t_val.shape) == (0,)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(sparse_count=0), "sparse_count"),
        (dict(layout_key="PA_BSND", actual_seq_lengths_key=[3, 3]), "block_table"),
        (
            dict(layout_key="PA_BSND", block_table=[[0], [9]], actual_seq_lengths_key=[3, 3]),
            "block_table",
        ),
        (dict(actual_seq_lengths_query=[5, 1]), "actual_seq_lengths_query"),
    ],
)
def test_lightning_indexer_errors_are_the_torch_bindings(kwargs, argument):
    arrays = [randn(2, 3, 4, 16), randn(2, 4, 1, 16), randn(2, 3, 4)]
    msg = _same_error(lambda conv: opmesh.lightning_indexer(*map(conv, arrays), **kwargs))
    assert msg.startswith(f"{argument}:"), msg


def sparse_case(layout_query, layout_kv, rope):
    """(arrays, indices, kwargs) of a small sparse attention call: N1 = 4 over N2 = 2."""
    n1, n2, d, dv, k_sel = 4, 2, 16, 8, 5
    if layout_query == "BSND":
        lead_q, qlens = (2, 9), None
    else:
        lead_q, qlens = (14,), [9, 14]
    if layout_kv == "PA_BSND":
        lead_k, klens = (8, 4), [11, 7]
        kw = dict(block_table=[[0, 1, 2, 3], [4, 5, 6, 7]], actual_seq_lengths_kv=klens)
    elif layout_kv == "BSND":
        lead_k, klens, kw = (2, 11), [11, 11], {}
    else:
        lead_k, klens, kw = (18,), [11, 18], dict(actual_seq_lengths_kv=[11, 18])
    arrays = [randn(*lead_q, n1, d), randn(*lead_k, n2, d), randn(*lead_k, n2, dv)]
    if rope:
        arrays += [randn(*lead_q, n1, 4), randn(*lead_k, n2, 4)]
    rows = 18 if layout_query == "BSND" else 14
    idx = np.full((rows, n2, k_sel), -1, np.int32)
    key_lens = klens if layout_kv != "TND" else [11, 7]
    for r in range(rows):
        b = r // 9 if layout_query == "BSND" else (0 if r < 9 else 1)
        for n in range(n2):
            idx[r, n, :4] = RNG.permutation(key_lens[b])[:4]
    idx = idx.reshape(*lead_q, n2, k_sel)
    kw.update(layout_query=layout_query, layout_kv=layout_kv, actual_seq_lengths_query=qlens)
    return arrays, idx, kw


@pytest.mark.parametrize(
    "layouts, rope, softcap",
    [
        (("BSND", "BSND"), True, None),
        (("BSND", "BSND"), True, 0.5),
        (("TND", "TND"), False, None),
        (("BSND", "PA_BSND"), False, None),
    ],
    ids=["bsnd-rope", "bsnd-rope-softcap", "tnd", "paged"],
)
def test_sparse_flash_attention_forward_and_backward_match_torch(layouts, rope, softcap):
    arrays, idx, kw = sparse_case(*layouts, rope)
    kw["softcap"] = softcap
    m_in, t_in = zip(*(both(a) for a in arrays), strict=True)
    m_sinks, t_sinks = both(randn(4))
    m_idx, t_idx = ms.Tensor(idx), torch.from_numpy(idx)
    names = ("query", "key", "value", "query_rope", "key_rope")[: len(arrays)]
    paged = layouts[1] == "PA_BSND"

    def run(idx_, sinks, *tensors):
        named = dict(zip(names, tensors, strict=True))
        q, k, v = named.pop("query"), named.pop("key"), named.pop("value")
        return opmesh.sparse_flash_attention(
            q, k, v, idx_, 0.3, sinks=sinks, return_softmax_lse=True, **named, **kw
        )

    m_out = run(m_idx, m_sinks, *m_in)
    t_out = run(t_idx, t_sinks, *t_in)
    assert isinstance(m_out[0], ms.Tensor)
    for m, t in zip(m_out, t_out, strict=True):
        assert_same(m, t)
    if paged:
        return

    def loss(sinks, *tensors):
        out = run(m_idx if isinstance(sinks, ms.Tensor) else t_idx, sinks, *tensors)[0]
        return (out * out).sum()

    m_grads = ms.grad(loss, grad_position=tuple(range(len(arrays) + 1)))(m_sinks, *m_in)
    leaves = [x.clone().requires_grad_() for x in (t_sinks, *t_in)]
    loss(*leaves).backward()
    for g, leaf in zip(m_grads, leaves, strict=True):
        assert_same(g, leaf.grad)


def test_sparse_flash_attention_errors_are_the_torch_bindings():
    arrays, idx, kw = sparse_case("BSND", "BSND", False)
    bad = idx.copy()
    bad[0, 2, 1, 0] = 40
    msg = _same_error(
        lambda conv: opmesh.sparse_flash_attention(*map(conv, arrays), conv(bad), 0.3, **kw)
    )
    assert msg.startswith("sparse_indices:"), msg
    msg = _same_error(
        lambda conv: opmesh.sparse_flash_attention(
            *map(conv, arrays[:2]), conv(arrays[2][:, :, :1]), conv(idx), 0.3, **kw
        )
    )
    assert msg.startswith("value:"), msg


# ---------------------------------------------------------------------------- sparse_flash_mla


def mla_case(layout_kv):
    """An HCA/CSA call: 2 sequences, 8 query heads over 1 key head, D = 32, cmp_ratio 4."""
    tnd = layout_kv != "BSND"
    lens, cmp_lens = [9, 14], [2, 3]
    kw = dict(cmp_ratio=4, ori_win_left=5, ori_win_right=0, softmax_scale=0.2,
              cmp_residual_kv=[1, 2])  # fmt: skip
    if layout_kv == "BSND":
        arrays = [randn(2, 14, 8, 32), randn(2, 14, 1, 32), randn(2, 3, 1, 32)]
        kw.update(seqused_q=lens, seqused_ori_kv=lens, seqused_cmp_kv=cmp_lens)
    else:
        arrays = [randn(sum(lens), 8, 32)]
        kw.update(layout_q="TND", cu_seqlens_q=[0, 9, 23])
        if layout_kv == "TND":
            arrays += [randn(sum(lens), 1, 32), randn(sum(cmp_lens), 1, 32)]
            kw.update(layout_kv="TND", cu_seqlens_ori_kv=[0, 9, 23], cu_seqlens_cmp_kv=[0, 2, 5])
        else:
            arrays += [randn(8, 4, 1, 32), randn(3, 4, 1, 32)]
            tables = dict(ori_block_table=[[3, 0, 5, 7], [1, 2, 4, 6]], cmp_block_table=[[2], [0]])
            kw.update(layout_kv="PA_BBND", seqused_ori_kv=lens, seqused_cmp_kv=cmp_lens, **tables)
    rows = 2 * 14 if not tnd else sum(lens)
    idx = np.full((rows, 1, 3), -1, np.int32)
    for r in range(rows):
        b = r // 14 if not tnd else int(r >= 9)
        idx[r, 0, :2] = RNG.permutation(cmp_lens[b] + 1)[:2] - 1
    lead = (2, 14) if not tnd else (rows,)
    return arrays, idx.reshape(*lead, 1, 3), kw


@pytest.mark.parametrize("layout_kv", ["BSND", "TND", "PA_BBND"])
def test_sparse_flash_mla_forward_and_backward_match_torch(layout_kv):
    arrays, idx, kw = mla_case(layout_kv)
    m_in, t_in = zip(*(both(a) for a in arrays), strict=True)
    m_sinks, t_sinks = both(randn(8))
    m_idx, t_idx = ms.Tensor(idx), torch.from_numpy(idx)

    def run(idx_, sinks, q, ori, cmp, **extra):
        return opmesh.sparse_flash_mla(
            q, ori_kv=ori, cmp_kv=cmp, cmp_sparse_indices=idx_, sinks=sinks,
            return_softmax_lse=True, **kw, **extra,
        )  # fmt: skip

    m_out = run(m_idx, m_sinks, *m_in)
    t_out = run(t_idx, t_sinks, *t_in)
    assert isinstance(m_out[0], ms.Tensor)
    for m, t in zip(m_out, t_out, strict=True):
        assert_same(m, t)
    # Planned: the plan made from MindSpore arrays, the same bits as torch's planned call.
    plan_kw = {n: kw[n] for n in kw if n.startswith(("cu_", "seqused", "layout", "cmp_res"))}
    plan_kw.update(
        cmp_ratio=4, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=5, ori_win_right=0,
        cmp_topk=3, max_seqlen_q=14, max_seqlen_ori_kv=14, max_seqlen_cmp_kv=3,
        batch_size=0 if "layout_q" in kw else 2, num_workers=3,
    )  # fmt: skip
    as_ms = {n: ms.Tensor(np.array(v, np.int32)) if isinstance(v, list) else v
             for n, v in plan_kw.items()}  # fmt: skip
    m_plan = opmesh.sparse_flash_mla_metadata(8, 1, 32, **as_ms)
    t_plan = opmesh.sparse_flash_mla_metadata(8, 1, 32, **plan_kw)
    assert isinstance(m_plan, ms.Tensor)
    np.testing.assert_array_equal(m_plan.asnumpy(), t_plan.numpy())  # int32 words
    for m, t in zip(run(m_idx, m_sinks, *m_in, metadata=m_plan),
                    run(t_idx, t_sinks, *t_in, metadata=t_plan), strict=True):  # fmt: skip
        assert_same(m, t)
    if layout_kv == "PA_BBND":
        return

    def loss(sinks, *tensors):
        out, lse = run(m_idx if isinstance(sinks, ms.Tensor) else t_idx, sinks, *tensors)
        return (out * out).sum() + (lse * lse).sum()

    m_grads = ms.grad(loss, grad_position=(0, 1, 2, 3))(m_sinks, *m_in)
    leaves = [x.clone().requires_grad_() for x in (t_sinks, *t_in)]
    loss(*leaves).backward()
    for g, leaf in zip(m_grads, leaves, strict=True):
        assert_same(g, leaf.grad)


def test_sparse_flash_mla_errors_are_the_torch_bindings():
    arrays, idx, kw = mla_case("TND")
    bad = idx.copy()
    bad[3, 0, 0] = 40
    msg = _same_error(
        lambda conv: opmesh.sparse_flash_mla(
            conv(arrays[0]), ori_kv=conv(arrays[1]), cmp_kv=conv(arrays[2]),
            cmp_sparse_indices=conv(bad), **kw,
        )
    )  # fmt: skip
    assert msg.startswith("cmp_sparse_indices:"), msg
    msg = _same_error(
        lambda conv: opmesh.sparse_flash_mla(
            conv(arrays[0]), ori_kv=conv(arrays[1][:, :, :16]), cmp_kv=conv(arrays[2]), **kw
        )
    )
    assert msg.startswith("ori_kv:"), msg


# ------------------------------------------------------------------------------ KL loss


def kl_inputs(layout, rope, dtype="float32"):
    n1, n2, d, dr, n1i, di = 4, 2, 16, 8, 8, 32
    if layout == "BSND":
        b, s1, s2 = 2, 9, 11
        lead_q, lead_k, lens = (b, s1), (b, s2), dict()
        stats = (b, n2, s1, n1 // n2)
    else:
        lens = dict(actual_seq_qlen=[4, 4, 9], actual_seq_klen=[5, 5, 11])
        lead_q, lead_k, stats = (9,), (11,), (n2, 9, n1 // n2)
    arrays = dict(
        query=randn(*lead_q, n1, d),
        key=randn(*lead_k, n2, d),
        query_index=randn(*lead_q, n1i, di),
        key_index=randn(*lead_k, 1, di),
        weights=randn(*lead_q, n1i, scale=0.2),
    )
    if rope:
        arrays.update(query_rope=randn(*lead_q, n1, dr), key_rope=randn(*lead_k, n2, dr))
    m = {k: both(v, dtype)[0] for k, v in arrays.items()}
    t = {k: both(v, dtype)[1] for k, v in arrays.items()}
    # The main attention's statistics from the torch reference of the same scores.
    t["softmax_max"] = torch.full(stats, 3.0)
    t["softmax_sum"] = torch.full(stats, 40.0)
    m["softmax_max"], m["softmax_sum"] = (
        ms.Tensor(t[k].numpy()) for k in ("softmax_max", "softmax_sum")
    )
    return m, t, dict(layout=layout, **lens)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_grad_kl_loss_matches_torch(layout, rope):
    m, t, kw = kl_inputs(layout, rope)
    outs = []
    for x in (m, t):
        stats = opmesh.dense_lightning_indexer_softmax_lse(
            x["query_index"], x["key_index"], x["weights"], **kw
        )
        outs.append(
            opmesh.dense_lightning_indexer_grad_kl_loss(
                x["query"],
                x["key"],
                x["query_index"],
                x["key_index"],
                x["weights"],
                x["softmax_max"],
                x["softmax_sum"],
                *stats,
                0.25,
                query_rope=x.get("query_rope"),
                key_rope=x.get("key_rope"),
                **kw,
            )
        )
    for a, b in zip(*outs, strict=True):
        assert_same(a, b)
    assert float(as_numpy(outs[0][3])[0]) > 0


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_indexer_kl_loss_gradients_through_mindspore_autograd(layout):
    m, t, kw = kl_inputs(layout, rope=False)
    fixed = ("query", "key", "softmax_max", "softmax_sum")

    def loss(qi, ki, w):
        out = opmesh.indexer_kl_loss(qi, ki, w, *(m[k] for k in fixed), 0.25, **kw)
        return (out * 3.0).sum()

    value, grads = ms.value_and_grad(loss, grad_position=(0, 1, 2))(
        m["query_index"], m["key_index"], m["weights"]
    )
    leaves = [t[k].requires_grad_() for k in ("query_index", "key_index", "weights")]
    t_loss = opmesh.indexer_kl_loss(*leaves, *(t[k] for k in fixed), 0.25, **kw)
    (t_loss * 3.0).sum().backward()
    np.testing.assert_array_equal(as_numpy(value), as_numpy(t_loss.sum() * 3.0))
    for g, leaf in zip(grads, leaves, strict=True):
        assert_same(g, leaf.grad)


def kl_selection(layout, heads=1, k=6):
    """sparse_indices for kl_inputs' shapes: per row distinct key positions (some the mask
    hides) and -1 padding, the same values as int64 on MindSpore and int32 on torch."""
    lead, keys = ((2, 9), 11) if layout == "BSND" else ((9,), 11)
    rows = np.full((*lead, heads, k), -1, dtype=np.int64)
    for pos in np.ndindex(*lead, heads):
        rows[pos][: k - 2] = RNG.permutation(keys)[: k - 2]
    if layout == "TND":  # sequence lengths 4, 0 and 5 keys of 5, 0 and 6: stay inside each
        rows[:4] = np.where(rows[:4] >= 5, -1, rows[:4])
        rows[4:] = np.where(rows[4:] >= 6, -1, rows[4:])
    return ms.Tensor(rows), torch.from_numpy(rows).int()


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sparse_grad_kl_loss_matches_torch(layout, rope):
    m, t, kw = kl_inputs(layout, rope)
    idx_m, idx_t = kl_selection(layout)
    outs = []
    for x, idx in ((m, idx_m), (t, idx_t)):
        outs.append(
            opmesh.sparse_lightning_indexer_grad_kl_loss(
                x["query"], x["key"], x["query_index"], x["key_index"], x["weights"], idx,
                x["softmax_max"], x["softmax_sum"], 0.25, query_rope=x.get("query_rope"),
                key_rope=x.get("key_rope"), **kw,
            )
        )  # fmt: skip
    for a, b in zip(*outs, strict=True):
        assert_same(a, b)
    assert float(as_numpy(outs[0][3])[0]) > 0


@pytest.mark.parametrize("sparse", [False, True])
def test_kl_losses_with_a_non_finite_input_match_torch(sparse):
    """A NaN in a row the call reads: a NaN loss and NaN gradient rows on MindSpore as on torch
    (the same core), the rows it does not write zero on both."""
    m, t, kw = kl_inputs("TND", rope=False)
    t["query_index"] = t["query_index"].clone()
    t["query_index"][6, 1, 3] = float("nan")
    m["query_index"] = ms.Tensor(t["query_index"].numpy())
    idx_m, idx_t = kl_selection("TND")
    outs = []
    for x, idx in ((m, idx_m), (t, idx_t)):
        common = (x["query"], x["key"], x["query_index"], x["key_index"], x["weights"])
        if sparse:
            outs.append(
                opmesh.sparse_lightning_indexer_grad_kl_loss(
                    *common, idx, x["softmax_max"], x["softmax_sum"], 0.25, **kw
                )
            )
        else:
            stats = opmesh.dense_lightning_indexer_softmax_lse(
                x["query_index"], x["key_index"], x["weights"], **kw
            )
            outs.append(
                opmesh.dense_lightning_indexer_grad_kl_loss(
                    *common, x["softmax_max"], x["softmax_sum"], *stats, 0.25, **kw
                )
            )
    for a, b in zip(*outs, strict=True):
        assert_same(a, b)
    assert np.isnan(as_numpy(outs[0][3])).all() and np.isnan(as_numpy(outs[0][0])[:4]).all()


def test_sparse_indexer_kl_loss_gradients_through_mindspore_autograd():
    m, t, kw = kl_inputs("BSND", rope=False)
    idx_m, idx_t = kl_selection("BSND")
    fixed = ("query", "key")
    stats = ("softmax_max", "softmax_sum")

    def loss(qi, ki, w):
        out = opmesh.sparse_indexer_kl_loss(
            qi, ki, w, *(m[k] for k in fixed), idx_m, *(m[k] for k in stats), 0.25, **kw
        )
        return (out * 3.0).sum()

    value, grads = ms.value_and_grad(loss, grad_position=(0, 1, 2))(
        m["query_index"], m["key_index"], m["weights"]
    )
    leaves = [t[k].requires_grad_() for k in ("query_index", "key_index", "weights")]
    t_loss = opmesh.sparse_indexer_kl_loss(
        *leaves, *(t[k] for k in fixed), idx_t, *(t[k] for k in stats), 0.25, **kw
    )
    (t_loss * 3.0).sum().backward()
    np.testing.assert_array_equal(as_numpy(value), as_numpy(t_loss.sum() * 3.0))
    for g, leaf in zip(grads, leaves, strict=True):
        assert_same(g, leaf.grad)


def test_sparse_kl_errors_are_the_torch_bindings():
    m, t, kw = kl_inputs("BSND", rope=False)
    names = ("query", "key", "query_index", "key_index", "weights")
    stats = ("softmax_max", "softmax_sum")

    def kl(conv, idx):
        x = {n: conv(as_numpy(t[n]).copy()) for n in (*names, *stats)}
        return opmesh.sparse_lightning_indexer_grad_kl_loss(
            *(x[n] for n in names), conv(idx), *(x[n] for n in stats), 0.25
        )

    twice = np.zeros((2, 9, 1, 3), np.int32)  # key 0 twice in every row
    assert _same_error(lambda conv: kl(conv, twice)).startswith("sparse_indices:")
    wide = np.full((2, 9, 1, 3), -1, np.int64)
    wide[0, 0, 0, 0] = 2**32  # int32 would wrap it onto key 0
    assert _same_error(lambda conv: kl(conv, wide)).startswith("sparse_indices:")
    flat = np.zeros((2, 9, 3), np.int32)
    assert _same_error(lambda conv: kl(conv, flat)).startswith("sparse_indices:")


# ---------------------------------------------------------------------------- flash_attn


def attn_case(layout, nq=4, nkv=2, d=16, dv=16):
    if layout == "TND":
        cu = [0, 5, 5, 14]
        cu_k = [0, 7, 9, 23]
        arrays = (randn(14, nq, d), randn(23, nkv, d), randn(23, nkv, dv))
        return arrays, dict(cu_seqlens_q=cu, cu_seqlens_kv=cu_k)
    if layout == "BNSD":
        return (randn(2, nq, 9, d), randn(2, nkv, 13, d), randn(2, nkv, 13, dv)), {}
    return (randn(2, 9, nq, d), randn(2, 13, nkv, d), randn(2, 13, nkv, dv)), {}


MASKS = [dict(mask_mode=0), dict(mask_mode=3), dict(mask_mode=4, win_left=3, win_right=1)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"mask{m['mask_mode']}")
@pytest.mark.parametrize("layout", ["BSND", "BNSD", "TND"])
def test_flash_attn_forward_and_backward_match_torch(layout, mask, dtype):
    arrays, lengths = attn_case(layout)
    sinks = randn(4)
    m_in, t_in = zip(*(both(a, dtype) for a in arrays), strict=True)
    kw = dict(layout_q=layout, return_softmax_lse=True, **lengths, **mask)
    m_sinks, t_sinks = both(sinks)

    def loss(q, k, v, s):
        out, lse = opmesh.flash_attn(q, k, v, sinks=s, **kw)
        return (out.float() * out.float()).sum() + lse.sum() * 0.5

    m_grads = ms.grad(loss, grad_position=(0, 1, 2, 3))(*m_in, m_sinks)
    leaves = [x.clone().requires_grad_() for x in (*t_in, t_sinks)]
    loss(*leaves).backward()
    m_out, m_lse = opmesh.flash_attn(*m_in, sinks=m_sinks, **kw)
    t_out, t_lse = opmesh.flash_attn(*t_in, sinks=t_sinks, **kw)
    assert isinstance(m_out, ms.Tensor) and m_out.dtype == m_in[0].dtype
    assert_same(m_out, t_out)
    assert_same(m_lse, t_lse)
    for g, leaf in zip(m_grads, leaves, strict=True):
        assert_same(g, leaf.grad)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_flash_attn_softcap_and_alibi_match_torch(layout, per_batch):
    arrays, lengths = attn_case(layout)
    m_in, t_in = zip(*(both(a) for a in arrays), strict=True)
    slopes = np.abs(randn(3 if layout == "TND" else 2, 4) if per_batch else randn(4)) * 0.3
    m_slopes, t_slopes = both(slopes)
    kw = dict(layout_q=layout, return_softmax_lse=True, mask_mode=3, softcap=1.5, **lengths)

    def loss(q, k, v, slopes):
        out, lse = opmesh.flash_attn(q, k, v, alibi_slopes=slopes, **kw)
        return (out.float() * out.float()).sum() + lse.sum() * 0.5

    m_grads = ms.grad(loss, grad_position=(0, 1, 2))(*m_in, m_slopes)
    leaves = [x.clone().requires_grad_() for x in t_in]
    loss(*leaves, t_slopes).backward()
    m_out, m_lse = opmesh.flash_attn(*m_in, alibi_slopes=m_slopes, **kw)
    t_out, t_lse = opmesh.flash_attn(*t_in, alibi_slopes=t_slopes, **kw)
    assert_same(m_out, t_out)
    assert_same(m_lse, t_lse)
    for g, leaf in zip(m_grads, leaves, strict=True):
        assert_same(g, leaf.grad)


def test_flash_attn_refuses_alibi_slopes_that_ask_for_a_gradient():
    """As on torch: the slopes have no gradient, so a Parameter that asks for one is refused
    instead of getting zeros; with requires_grad=False it runs."""
    arrays, lengths = attn_case("BSND")
    m_in = [both(a)[0] for a in arrays]
    slopes = both(np.abs(randn(4)) * 0.3)[0]
    trained = ms.Parameter(slopes, name="slopes")
    with pytest.raises(ValueError, match="^alibi_slopes: "):
        opmesh.flash_attn(*m_in, alibi_slopes=trained, mask_mode=3, **lengths)
    fixed = ms.Parameter(slopes, name="fixed_slopes", requires_grad=False)
    out, _ = opmesh.flash_attn(*m_in, alibi_slopes=fixed, mask_mode=3, **lengths)
    expected, _ = opmesh.flash_attn(*m_in, alibi_slopes=slopes, mask_mode=3, **lengths)
    assert np.array_equal(out.asnumpy(), expected.asnumpy())


def test_flash_attn_without_lse_returns_an_empty_second_output():
    arrays, _ = attn_case("BSND")
    m_in, t_in = zip(*(both(a) for a in arrays), strict=True)
    m_out, m_lse = opmesh.flash_attn(*m_in, mask_mode=3)
    t_out, t_lse = opmesh.flash_attn(*t_in, mask_mode=3)
    assert_same(m_out, t_out)
    assert tuple(m_lse.shape) == tuple(t_lse.shape) == (0,)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_no_heads_gives_empty_outputs_as_on_torch(layout):
    """A rank's empty shard of the heads: q, k and v with 0 heads give empty outputs and zero
    gradients on both frameworks; the indexer and its KL loss likewise (loss 0)."""
    arrays, lengths = attn_case(layout)
    no_heads = [a[..., :0, :] for a in arrays]
    m_in, t_in = zip(*(both(a) for a in no_heads), strict=True)
    kw = dict(layout_q=layout, return_softmax_lse=True, mask_mode=3, **lengths)
    outs = [opmesh.flash_attn(*x, **kw) for x in (m_in, t_in)]
    for a, b in zip(*outs, strict=True):
        assert_same(a, b)
    m_grads = ms.grad(lambda q, k, v: opmesh.flash_attn(q, k, v, **kw)[0].sum(), (0, 1, 2))(*m_in)
    for g, x in zip(m_grads, m_in, strict=True):
        assert tuple(g.shape) == tuple(x.shape)
    qlens, klens = ([4, 4, 11], [6, 6, 19]) if layout == "TND" else (None, None)
    idx = indexer_inputs(layout, "float32", qlens, klens, n1=0, n2=0)
    ikw = dict(layout=layout, actual_seq_qlen=qlens, actual_seq_klen=klens)
    stats = [
        opmesh.dense_lightning_indexer_softmax_lse(*(pair[i] for pair in idx), **ikw)
        for i in (0, 1)
    ]
    for a, b in zip(*stats, strict=True):
        assert_same(a, b)


def paged_case():
    block_size, nkv, d = 4, 2, 16
    k_cache, v_cache = randn(9, block_size, nkv, d), randn(9, block_size, nkv, d)
    table = np.array([[3, 0, 7], [8, 1, 2]], np.int32)
    used = np.array([10, 5], np.int32)
    q = randn(2, 3, 4, d)
    return q, k_cache, v_cache, table, used


def test_paged_decode_with_a_plan_matches_torch():
    q, kc, vc, table, used = paged_case()
    plan_kw = dict(batch_size=2, max_seqlen_q=3, max_seqlen_kv=12, mask_mode=3, num_workers=3)
    plan_kw.update(layout_kv="PA_BBND")
    m_plan = opmesh.flash_attn_metadata(4, 2, 16, seqused_kv=ms.Tensor(used), **plan_kw)
    t_plan = opmesh.flash_attn_metadata(4, 2, 16, seqused_kv=torch.from_numpy(used), **plan_kw)
    assert isinstance(m_plan, ms.Tensor)
    np.testing.assert_array_equal(m_plan.asnumpy(), t_plan.numpy())
    outs = []
    for conv, plan in ((ms.Tensor, m_plan), (torch.from_numpy, t_plan)):
        outs.append(
            opmesh.flash_attn(
                conv(q),
                conv(kc),
                conv(vc),
                block_table=conv(table),
                seqused_kv=conv(used),
                metadata=plan,
                mask_mode=3,
                max_seqlen_kv=12,
                return_softmax_lse=True,
            )
        )
    for a, b in zip(*outs, strict=True):
        assert_same(a, b)


def test_kv_cache_write_in_place_matches_torch():
    key, value = randn(5, 2, 16), randn(5, 2, 8)
    k_cache, v_cache = np.zeros((3, 4, 2, 16), np.float32), np.zeros((3, 4, 2, 8), np.float32)
    slots = [6, 0, -1, 11, 3]
    m_caches = (ms.Tensor(k_cache), ms.Tensor(v_cache))
    t_caches = (torch.from_numpy(k_cache.copy()), torch.from_numpy(v_cache.copy()))
    opmesh.kv_cache_write_(ms.Tensor(key), ms.Tensor(value), *m_caches, ms.Tensor(np.array(slots)))
    opmesh.kv_cache_write_(torch.from_numpy(key), torch.from_numpy(value), *t_caches, slots)
    for a, b in zip(m_caches, t_caches, strict=True):
        assert_same(a, b)
    assert np.abs(as_numpy(m_caches[0])).sum() > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_int8_cache_is_written_and_read_as_torch_does(dtype):
    """kv_cache_write_ quantizing into an int8 paged cache with its scales, then a paged decode
    from it, on MindSpore tensors: the bytes, the scales and the attention equal torch's."""
    key, value = both(randn(6, 2, 16), dtype), both(randn(6, 2, 16, scale=3.0), dtype)
    caches = [np.zeros((3, 4, 2, 16), np.int8) for _ in range(2)]
    scales = [np.zeros((3, 4, 2), np.float32) for _ in range(2)]
    slots = [6, 0, 11, 1, 2, 3]
    m_caches = [ms.Tensor(c) for c in caches + scales]
    t_caches = [torch.from_numpy(c.copy()) for c in caches + scales]
    opmesh.kv_cache_write_(
        key[0], value[0], m_caches[0], m_caches[1], ms.Tensor(np.array(slots)),
        key_scale=m_caches[2], value_scale=m_caches[3],
    )  # fmt: skip
    opmesh.kv_cache_write_(
        key[1], value[1], t_caches[0], t_caches[1], slots,
        key_scale=t_caches[2], value_scale=t_caches[3],
    )  # fmt: skip
    for a, b in zip(m_caches, t_caches, strict=True):
        assert_same(a, b)
    q = both(randn(2, 1, 4, 16), dtype)
    table, used = np.array([[1, 0], [2, 0]], np.int32), np.array([7, 4], np.int32)
    outs = [
        opmesh.flash_attn(
            qq,
            *c[:2],
            k_scale=c[2],
            v_scale=c[3],
            block_table=tb,
            seqused_kv=u,
            return_softmax_lse=True,
        )  # fmt: skip
        for qq, c, tb, u in (
            (q[0], m_caches, ms.Tensor(table), ms.Tensor(used)),
            (q[1], t_caches, torch.from_numpy(table), torch.from_numpy(used)),
        )
    ]
    for a, b in zip(*outs, strict=True):
        assert_same(a, b)

    def loss(qq):
        out, _ = opmesh.flash_attn(
            qq, *m_caches[:2], k_scale=m_caches[2], v_scale=m_caches[3],
            block_table=ms.Tensor(table), seqused_kv=ms.Tensor(used),
        )  # fmt: skip
        return out.float().sum()

    with pytest.raises(ValueError, match="^k_scale: flash_attn has no backward"):
        ms.grad(loss)(q[0])


def test_sparse_attention_refuses_a_quantized_key_by_name():
    q, k = ms.Tensor(randn(1, 2, 2, 16)), ms.Tensor(np.zeros((1, 4, 1, 16), np.int8))
    scale = ms.Tensor(np.ones((1, 4, 1), np.float32))
    idx = ms.Tensor(np.zeros((1, 2, 1, 1), np.int32))
    with pytest.raises(NotImplementedError, match="^key_scale: "):
        opmesh.sparse_flash_attention(q, k, k, idx, 0.3, key_scale=scale, value_scale=scale)


def test_kv_cache_write_refuses_one_shared_cache_by_name():
    key, cache = ms.Tensor(randn(2, 1, 16)), ms.Tensor(np.zeros((2, 4, 1, 16), np.float32))
    with pytest.raises(NotImplementedError, match="^value: "):
        opmesh.kv_cache_write_(key, None, cache, None, [0, 1])


def test_sparse_flash_mla_refuses_a_quantized_kv_by_name():
    q, kv = ms.Tensor(randn(1, 2, 2, 16)), ms.Tensor(np.zeros((1, 4, 1, 16), np.int8))
    scale = ms.Tensor(np.ones((1, 4, 1), np.float32))
    with pytest.raises(NotImplementedError, match="^ori_kv_scale: "):
        opmesh.sparse_flash_mla(q, ori_kv=kv, ori_kv_scale=scale)


def test_describe_metadata_reads_a_mindspore_plan():
    plan = opmesh.flash_attn_metadata(
        4,
        2,
        16,
        seqused_kv=ms.Tensor(np.array([7, 2], np.int32)),
        batch_size=2,
        max_seqlen_q=1,
        max_seqlen_kv=8,
        num_workers=2,
    )
    assert opmesh.describe_metadata(plan)["num_workers"] == 2


# ---------------------------------------------------------------- DFunction on both frameworks


class TemperedKlLoss(opmesh.DFunction):
    """A user's DFunction, written once on local tensors: the indexer's KL loss divided by a
    temperature, its backward scaling the fused gradients."""

    @staticmethod
    def forward(ctx, query_index, key_index, weights, query, key, smax, ssum, temperature):
        stats = opmesh.dense_lightning_indexer_softmax_lse(query_index, key_index, weights)
        dqi, dki, dw, loss = opmesh.dense_lightning_indexer_grad_kl_loss(
            query, key, query_index, key_index, weights, smax, ssum, *stats, 0.25
        )
        ctx.save_for_backward(dqi, dki, dw)
        ctx.temperature = temperature
        return loss / temperature

    @staticmethod
    def backward(ctx, grad):
        scale = grad / ctx.temperature
        grads = tuple(g * scale for g in ctx.saved_tensors)
        return (*grads, None, None, None, None, None)


def test_the_same_dfunction_runs_forward_and_backward_on_both_frameworks():
    m, t, _ = kl_inputs("BSND", rope=False)
    order = ("query", "key", "softmax_max", "softmax_sum")

    def m_loss(qi, ki, w):
        return TemperedKlLoss.apply(qi, ki, w, *(m[k] for k in order), 2.0).sum()

    m_value, m_grads = ms.value_and_grad(m_loss, grad_position=(0, 1, 2))(
        m["query_index"], m["key_index"], m["weights"]
    )
    leaves = [t[k].requires_grad_() for k in ("query_index", "key_index", "weights")]
    t_value = TemperedKlLoss.apply(*leaves, *(t[k] for k in order), 2.0).sum()
    t_value.backward()
    np.testing.assert_array_equal(as_numpy(m_value), as_numpy(t_value))
    for g, leaf in zip(m_grads, leaves, strict=True):
        assert_same(g, leaf.grad)
        assert np.abs(as_numpy(g)).sum() > 0


def test_default_platform_mindspore_in_a_fresh_process():
    """OPMESH_PLATFORM=mindspore: DFunction derives from MindSpore's autograd base, plans are
    MindSpore tensors, and the distributed layer refuses clearly."""
    code = r"""
import numpy as np, mindspore as ms, torch, opmesh
from mindspore.common._grad_function import _Function
assert issubclass(opmesh.DFunction, _Function)
plan = opmesh.flash_attn_metadata(2, 1, 8, batch_size=1, max_seqlen_q=4, max_seqlen_kv=4)
assert isinstance(plan, ms.Tensor), type(plan)
class Double(opmesh.DFunction):
    @staticmethod
    def forward(ctx, x):
        return x * 2
    @staticmethod
    def backward(ctx, g):
        return g * 2
x = ms.Tensor(np.ones(3, np.float32))
assert ms.grad(lambda x: Double.apply(x).sum())(x).asnumpy().tolist() == [2.0] * 3
t = torch.ones(3, requires_grad=True)
Double.apply(t).sum().backward()
assert t.grad.tolist() == [2.0] * 3
try:
    opmesh.platform.current().DTensor
except NotImplementedError as e:
    assert "DTensor" in str(e), e
else:
    raise AssertionError("no error")
print("ok")
"""
    env = dict(os.environ, OPMESH_PLATFORM="mindspore")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


# ------------------------------------------------------------------------------------ errors


def torch_message(fn):
    with pytest.raises((ValueError, TypeError)) as info:
        fn()
    return type(info.value), str(info.value).splitlines()[0]


@pytest.mark.parametrize(
    "change, argument",
    [
        (dict(k=lambda a: a[:, :, :, :8]), "k"),
        (dict(v=lambda a: a[:1]), "v"),
        (dict(q=lambda a: a[0]), "q"),
        (dict(layout_q="TND"), "q"),
        (dict(mask_mode=2), "mask_mode"),
        (dict(win_left=-5, mask_mode=4), "win_left"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_flash_attn_shape_errors_are_the_torch_bindings(change, argument):
    arrays, _ = attn_case("BSND")
    names = ("q", "k", "v")
    kw = {k: v for k, v in change.items() if k not in names}
    m_in = [ms.Tensor(change.get(n, lambda a: a)(a)) for n, a in zip(names, arrays, strict=True)]
    t_in = [
        torch.from_numpy(change.get(n, lambda a: a)(a)) for n, a in zip(names, arrays, strict=True)
    ]
    t_type, t_msg = torch_message(lambda: opmesh.flash_attn(*t_in, **kw))
    with pytest.raises(t_type) as info:
        opmesh.flash_attn(*m_in, **kw)
    assert str(info.value).startswith(f"{argument}:")
    assert str(info.value).splitlines()[0] == t_msg


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(cu_seqlens_q=[0, 5, 4, 14], cu_seqlens_kv=[0, 7, 9, 23]), "cu_seqlens_q"),
        (dict(cu_seqlens_q=[0, 5, 5, 13], cu_seqlens_kv=[0, 7, 9, 23]), "cu_seqlens_q"),
        (
            dict(cu_seqlens_q=[0, 5, 5, 14], cu_seqlens_kv=[0, 7, 9, 23], seqused_kv=[1, 2]),
            "seqused_kv",
        ),
        (dict(cu_seqlens_q=[0, 5, 5, 14], cu_seqlens_kv=[0, 7, 9, 2**33]), "cu_seqlens_kv"),
    ],
)
def test_flash_attn_length_errors_name_the_argument(kwargs, argument):
    arrays, _ = attn_case("TND")
    m_in = [ms.Tensor(a) for a in arrays]
    t_in = [torch.from_numpy(a) for a in arrays]
    t_type, t_msg = torch_message(lambda: opmesh.flash_attn(*t_in, layout_q="TND", **kwargs))
    with pytest.raises(t_type) as info:
        opmesh.flash_attn(*m_in, layout_q="TND", **kwargs)
    assert str(info.value).startswith(f"{argument}:")
    assert str(info.value).splitlines()[0] == t_msg


def test_data_errors_raise_at_the_call():
    q, kc, vc, table, used = paged_case()
    bad_table = table.copy()
    bad_table[1, 0] = 99
    with pytest.raises(ValueError, match=r"^block_table: entry \[1, 0\] is 99"):
        opmesh.flash_attn(
            ms.Tensor(q),
            ms.Tensor(kc),
            ms.Tensor(vc),
            block_table=ms.Tensor(bad_table),
            seqused_kv=ms.Tensor(used),
            mask_mode=3,
        )
    plan = opmesh.flash_attn_metadata(
        4,
        2,
        16,
        seqused_kv=ms.Tensor(used),
        batch_size=2,
        max_seqlen_q=3,
        max_seqlen_kv=12,
        layout_kv="PA_BBND",
    )
    with pytest.raises(ValueError, match="^metadata:"):
        opmesh.flash_attn(
            ms.Tensor(q),
            ms.Tensor(kc),
            ms.Tensor(vc),
            block_table=ms.Tensor(table),
            seqused_kv=ms.Tensor(used),
            metadata=plan,
            mask_mode=3,
        )
    key, value = ms.Tensor(randn(2, 2, 16)), ms.Tensor(randn(2, 2, 16))
    caches = (
        ms.Tensor(np.zeros((3, 4, 2, 16), np.float32)),
        ms.Tensor(np.zeros((3, 4, 2, 16), np.float32)),
    )
    with pytest.raises(ValueError, match="^slot_mapping: slot 5 is written by tokens 0 and 1"):
        opmesh.kv_cache_write_(key, value, *caches, [5, 5])
    with pytest.raises(ValueError, match="^slot_mapping: entry 1 is 12"):
        opmesh.kv_cache_write_(key, value, *caches, [5, 12])
    with pytest.raises(ValueError, match="^actual_seq_klen:"):
        (mq, _), (mk, _), (mw, _) = indexer_inputs("BSND", "float32", None, None)
        opmesh.dense_lightning_indexer_softmax_lse(mq, mk, mw, actual_seq_klen=[1, 2, 18])


def test_mixed_frameworks_and_mesh_requests_are_refused():
    arrays, _ = attn_case("BSND")
    with pytest.raises(TypeError, match="^k: expected a MindSpore tensor"):
        opmesh.flash_attn(ms.Tensor(arrays[0]), torch.from_numpy(arrays[1]), ms.Tensor(arrays[2]))
    with pytest.raises(TypeError, match="^actual_seq_qlen: expected int32 or int64"):
        (mq, _), (mk, _), (mw, _) = indexer_inputs("BSND", "float32", None, None)
        opmesh.dense_lightning_indexer_softmax_lse(
            mq, mk, mw, actual_seq_qlen=ms.Tensor(np.ones(3, np.float32))
        )
    with pytest.raises(NotImplementedError, match="^out_a: merge_attn_states takes PyTorch"):
        x = ms.Tensor(randn(1, 2, 2, 4))
        opmesh.merge_attn_states(x, x, x, x)
    with pytest.raises(NotImplementedError, match="DTensor"):
        opmesh.platform.get("mindspore").from_local(None, None, ())


def test_mindspore_demo_runs_and_trains():
    result = subprocess.run(
        [sys.executable, "-m", "opmesh", "demo", "--framework", "mindspore"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bitwise equal to the torch binding on the same inputs: True" in result.stdout
    first, last = result.stdout.strip().splitlines()[-1].split(":")[-1].split("->")
    assert float(last) < 0.8 * float(first), result.stdout


def _same_error(call):
    """Runs call(framework) for torch and MindSpore; both raise the same type and first line."""
    t_type, t_msg = torch_message(lambda: call(torch.from_numpy))
    with pytest.raises(t_type) as info:
        call(ms.Tensor)
    assert str(info.value).splitlines()[0] == t_msg
    return t_msg


@pytest.mark.parametrize(
    "shapes, argument",
    [
        (((2, 9, 4, 16), (2, 9, 1, 8), (2, 9, 4)), "key_index"),
        (((2, 9, 4, 16), (2, 9, 3, 16), (2, 9, 4)), "key_index"),
        (((2, 9, 4, 16), (2, 9, 1, 16), (2, 9, 5)), "weights"),
        (((9, 4, 16), (9, 1, 16), (9, 4)), "query_index"),
    ],
)
def test_indexer_errors_are_the_torch_bindings(shapes, argument):
    arrays = [randn(*s) for s in shapes]
    msg = _same_error(lambda conv: opmesh.dense_lightning_indexer_softmax_lse(*map(conv, arrays)))
    assert msg.startswith(f"{argument}:"), msg


def test_kl_and_cache_errors_are_the_torch_bindings():
    m, t, kw = kl_inputs("BSND", rope=False)
    names = ("query", "key", "query_index", "key_index", "weights", "softmax_max", "softmax_sum")

    def kl(conv):
        x = {n: conv(as_numpy(t[n]).copy()) for n in names}
        bad = conv(np.zeros((2, 1, 9), np.float32))  # the index statistics' shape is [2, 1, 9]
        return opmesh.dense_lightning_indexer_grad_kl_loss(
            *(x[n] for n in names), bad, conv(np.zeros((2, 1, 8), np.float32)), 0.25
        )

    assert _same_error(kl).startswith("softmax_sum_index:")

    def cache(conv):
        key, value = conv(randn(2, 2, 16)), conv(randn(2, 2, 8))
        caches = (
            conv(np.zeros((3, 4, 2, 16), np.float32)),
            conv(np.zeros((3, 4, 2, 16), np.float32)),
        )
        return opmesh.kv_cache_write_(key, value, *caches, [0, 1])

    assert _same_error(cache).startswith("value")


def test_synchronous_launch_mode():
    """With pynative_synchronize MindSpore may launch on the calling thread: the op still runs
    (no hand-off to wait for) and matches torch, forward and gradient."""
    code = r"""
import numpy as np, mindspore as ms, torch, opmesh
ms.set_context(pynative_synchronize=True)
rng = np.random.default_rng(0)
q, k = (rng.standard_normal(s).astype(np.float32) for s in ((2, 32, 4, 16), (2, 32, 2, 16)))
o, _ = opmesh.flash_attn(ms.Tensor(q), ms.Tensor(k), ms.Tensor(k), mask_mode=3)
t, _ = opmesh.flash_attn(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(k), mask_mode=3)
assert np.array_equal(o.asnumpy(), t.numpy())
g = ms.grad(lambda a: opmesh.flash_attn(a, ms.Tensor(k), ms.Tensor(k), mask_mode=3)[0].sum())
assert g(ms.Tensor(q)).shape == (2, 32, 4, 16)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_the_binding_refuses_what_would_read_out_of_bounds_when_called_directly():
    """The binding trusts the shared checks in front of it, but a direct call with shapes or
    host arrays that do not fit still gets a ValueError, never a read past an end."""
    from opmesh.platform import mindspore_ops

    ext = mindspore_ops.extension()
    q, k, w = ms.Tensor(randn(9, 4, 16)), ms.Tensor(randn(2, 9, 1, 16)), ms.Tensor(randn(2, 9, 4))
    with pytest.raises(ValueError, match="^query_index: expected 4 dims"):
        ext.indexer(query_index=q, key_index=k, weights=w, pre_tokens=2**62, next_tokens=2**62)
    key, value = ms.Tensor(randn(2, 2, 16)), ms.Tensor(randn(2, 2, 16))
    small = ms.Tensor(np.zeros((3, 4, 2, 8), np.float32))
    caches = dict(key=key, value=value, key_cache=small, value_cache=small)
    with pytest.raises(ValueError, match="^value_cache: shapes"):
        ext.kv_cache_write(**caches, slot_mapping=[0, 1])
    with pytest.raises(ValueError, match="^slot_mapping: expected one entry per token"):
        ext.kv_cache_write(**caches, slot_mapping=[0])
    arrays, _ = attn_case("TND")
    tnd = dict(zip("qkv", (ms.Tensor(a) for a in arrays), strict=True))
    layouts = dict(layout_q="TND", layout_kv="TND", layout_out="TND")
    with pytest.raises(ValueError, match="^cu_seqlens_q: required"):
        ext.flash_attn(**tnd, **layouts)
    with pytest.raises(ValueError, match="^cu_seqlens_kv: expected 4 entries"):
        ext.flash_attn(**tnd, **layouts, cu_seqlens_q=[0, 5, 5, 14], cu_seqlens_kv=[0, 23])
    # Arguments are the operator's schema, by name.
    with pytest.raises(TypeError, match="^flash_attn: missing argument q"):
        ext.flash_attn(k=tnd["k"], v=tnd["v"])
    with pytest.raises(TypeError, match="^flash_attn: an argument is not in its schema"):
        ext.flash_attn(**tnd, **layouts, window=3)


def test_paged_backward_is_refused_as_on_torch():
    q, kc, vc, table, used = paged_case()

    def loss(conv, q):
        out, _ = opmesh.flash_attn(
            q, conv(kc), conv(vc), block_table=conv(table), seqused_kv=conv(used), mask_mode=3
        )
        return out.sum()

    tq = torch.from_numpy(q).requires_grad_()
    t_type, t_msg = torch_message(lambda: loss(torch.from_numpy, tq).backward())
    with pytest.raises(t_type) as info:
        ms.grad(lambda x: loss(ms.Tensor, x))(ms.Tensor(q))
    assert str(info.value).splitlines()[0] == t_msg
    assert t_msg.startswith("layout_kv: PA_BBND")


def test_fused_kl_loss_is_differentiable_as_on_torch():
    """The fused op's loss carries its gradients back to query_index, key_index and weights
    (scaled by the loss's gradient) on MindSpore too: none is dropped."""
    m, t, kw = kl_inputs("TND", rope=False)
    names = ("query", "key", "query_index", "key_index", "weights", "softmax_max", "softmax_sum")

    def call(x, qi, ki, w):
        stats = opmesh.dense_lightning_indexer_softmax_lse(qi, ki, w, **kw)
        inputs = dict(x, query_index=qi, key_index=ki, weights=w)
        out = opmesh.dense_lightning_indexer_grad_kl_loss(
            *(inputs[n] for n in names), *stats, 0.25, **kw
        )
        return out[3].sum() * 5.0

    value, grads = ms.value_and_grad(lambda qi, ki, w: call(m, qi, ki, w), grad_position=(0, 1, 2))(
        m["query_index"], m["key_index"], m["weights"]
    )
    leaves = [t[k].requires_grad_() for k in ("query_index", "key_index", "weights")]
    t_value = call(t, *leaves)
    t_value.backward()
    np.testing.assert_array_equal(as_numpy(value), as_numpy(t_value))
    for g, leaf in zip(grads, leaves, strict=True):
        assert_same(g, leaf.grad)
        assert np.abs(as_numpy(g)).sum() > 0


def test_int_and_bool_arguments_are_taken_strictly():
    """As on PyTorch: a bool where an int is declared, or an int other than 0/1 where a bool
    is, is a TypeError naming the argument, at the public function and at the binding."""
    from opmesh.platform import mindspore_ops

    q, k, w = (ms.Tensor(a) for a in (randn(1, 6, 4, 16), randn(1, 6, 1, 16), randn(1, 6, 4)))
    with pytest.raises(TypeError, match="^sparse_count: expected an int"):
        opmesh.lightning_indexer(q, k, w, sparse_count=True)
    with pytest.raises(TypeError, match="^return_value: expected a bool"):
        opmesh.lightning_indexer(q, k, w, sparse_count=3, return_value=2)
    call = dict(query=q, key=k, weights=w, sparse_count=True)
    with pytest.raises(TypeError, match="^sparse_count: expected an int, got a bool"):
        mindspore_ops._call("lightning_indexer", **call)
    with pytest.raises(TypeError, match="^return_value: expected a bool"):
        mindspore_ops._call("lightning_indexer", **dict(call, sparse_count=3, return_value=2))
    indices = mindspore_ops._call("lightning_indexer", **dict(call, sparse_count=3, return_value=1))
    assert tuple(indices[1].shape) == (1, 6, 1, 3)


# --------------------------------------------------------------------------------- compressor


@pytest.mark.parametrize("packed", [False, True], ids=["BSH", "TH"])
def test_compressor_forward_state_and_backward_match_torch(packed):
    x = randn(17, 12) if packed else randn(2, 9, 12)
    arrays = (x, randn(16, 12, scale=0.3), randn(16, 12, scale=0.3), randn(4, 16))
    m_in, t_in = zip(*(both(a) for a in arrays), strict=True)
    kw = dict(coff=2, start_pos=[3, 5], state_block_table=[[1, 2, 3, 4], [5, 6, 7, 0]])
    if packed:
        kw["cu_seqlens"] = [0, 8, 17]
    state = randn(8, 4, 32)
    m_state, t_state = ms.Tensor(state.copy()), torch.from_numpy(state.copy())
    m_out = opmesh.compressor(m_in[0], m_in[1], m_in[2], m_state, m_in[3], 4, **kw)
    t_out = opmesh.compressor(t_in[0], t_in[1], t_in[2], t_state, t_in[3], 4, **kw)
    assert isinstance(m_out, ms.Tensor)
    assert_same(m_out, t_out)
    assert_same(m_state, t_state)  # written in place alike

    # Gradients without history (start 0, no state).
    kw = {n: v for n, v in kw.items() if n == "cu_seqlens"} | {"coff": 2, "seqused": [8, 6]}

    def loss(*tensors):
        out = opmesh.compressor(tensors[0], tensors[1], tensors[2], None, tensors[3], 4, **kw)
        return (out * out).sum()

    m_grads = ms.grad(loss, grad_position=(0, 1, 2, 3))(*m_in)
    leaves = [t.clone().requires_grad_() for t in t_in]
    loss(*leaves).backward()
    for g, leaf in zip(m_grads, leaves, strict=True):
        assert_same(g, leaf.grad)


@pytest.mark.parametrize("batch", [0, 2])
@pytest.mark.parametrize("cache_mode", [1, 2])
def test_compressor_tables_as_lists_match_torch(cache_mode, batch):
    """Ring tables ([B]) and continuous ones ([B, blocks]) as lists, with and without sequences."""
    arrays = (randn(batch, 9, 12), randn(8, 12, scale=0.3), randn(8, 12, scale=0.3), randn(3, 8))
    m_in, t_in = zip(*(both(a) for a in arrays), strict=True)
    table = [[1, 2, 3], [4, 5, 6]] if cache_mode == 1 else [1, 4]
    kw = dict(start_pos=[2, 5][:batch], state_block_table=table[:batch], cache_mode=cache_mode)
    state = randn(7, 8, 16)
    m_state, t_state = ms.Tensor(state.copy()), torch.from_numpy(state.copy())
    m_out = opmesh.compressor(m_in[0], m_in[1], m_in[2], m_state, m_in[3], 3, **kw)
    t_out = opmesh.compressor(t_in[0], t_in[1], t_in[2], t_state, t_in[3], 3, **kw)
    assert tuple(m_out.shape) == (batch, 3, 8)
    assert_same(m_out, t_out)
    assert_same(m_state, t_state)


def test_compressor_errors_are_the_torch_bindings():
    x, w, ape = randn(2, 9, 12), randn(16, 12), randn(4, 16)
    msg = _same_error(lambda conv: opmesh.compressor(conv(x), conv(w), conv(w), None, conv(ape),
                                                      4, coff=2, seqused=[10, 1]))  # fmt: skip
    assert msg.startswith("seqused:"), msg
    msg = _same_error(lambda conv: opmesh.compressor(conv(x), conv(w), conv(w), None, conv(ape),
                                                      3, coff=2))  # fmt: skip
    assert msg.startswith("ape:"), msg


def test_compressor_keeps_its_projections_for_the_backward(monkeypatch):
    """With a gradient to come (MindSpore's needs_input_grad) the forward writes every token's
    projections, as on PyTorch, and the backward reads them instead of computing them again;
    without one it keeps none."""
    from opmesh.platform import mindspore_ops

    x, w, ape = randn(2, 9, 12), randn(16, 12, scale=0.3), randn(4, 16)
    calls = []
    real = mindspore_ops._call

    def spy(name, **kwargs):
        calls.append((name, kwargs.get("projections")))
        return real(name, **kwargs)

    monkeypatch.setattr(mindspore_ops, "_call", spy)
    m_in = [ms.Tensor(a) for a in (x, w, w.copy(), ape)]

    def loss(*tensors):
        out = opmesh.compressor(tensors[0], tensors[1], tensors[2], None, tensors[3], 4, coff=2)
        return (out * out).sum()

    ms.grad(loss, grad_position=(0, 1, 2, 3))(*m_in)
    assert [n for n, _ in calls] == ["compressor", "compressor_backward"]
    kept = calls[1][1]
    assert kept is not None and calls[0][1] is kept
    t_kept = torch.zeros(2, 9, 32)
    torch_in = [torch.from_numpy(a) for a in (x, w, w.copy(), ape)]
    opmesh.compressor(*torch_in[:3], None, torch_in[3], 4, coff=2, projections=t_kept)
    assert_same(kept, t_kept)
    calls.clear()
    fresh = [ms.Tensor(a) for a in (x, w, w.copy(), ape)]  # tensors no gradient has reached
    opmesh.compressor(*fresh[:3], None, fresh[3], 4, coff=2)
    assert calls == [("compressor", None)]
