"""Every bad input raises a Python exception that names the argument (never a crash or NaN)."""

import pytest
import torch
from conftest import assert_raises_named

import opmesh


def bsnd(b=2, s1=5, s2=7, n1=4, n2=2, d=8, dtype=torch.float32):
    return (
        torch.randn(b, s1, n1, d, dtype=dtype),
        torch.randn(b, s2, n2, d, dtype=dtype),
        torch.randn(b, s1, n1, dtype=dtype),
    )


def tnd(t1=6, t2=9, n1=4, n2=2, d=8):
    return torch.randn(t1, n1, d), torch.randn(t2, n2, d), torch.randn(t1, n1)


def call(q, k, w, **kwargs):
    return opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **kwargs)


q, k, w = bsnd()
tq, tk, tw = tnd()
TND_LENS = dict(actual_seq_qlen=[2, 6], actual_seq_klen=[4, 9], layout="TND")

CASES = {
    "query_int_dtype": (TypeError, "query_index", lambda: call(q.int(), k.int(), w)),
    "key_dtype_mix": (TypeError, "key_index", lambda: call(q, k.bfloat16(), w)),
    "weights_dtype": (TypeError, "weights", lambda: call(q.bfloat16(), k.bfloat16(), w.half())),
    "device_mix": (ValueError, "key_index", lambda: call(q, k.to("meta"), w)),
    "query_rank": (ValueError, "query_index", lambda: call(q[0], k, w)),
    "key_rank": (ValueError, "key_index", lambda: call(q, k[0], w)),
    "weights_rank": (ValueError, "weights", lambda: call(q, k, w[0])),
    "tnd_rank": (ValueError, "query_index", lambda: call(q, k, w, **TND_LENS)),
    "heads_not_multiple": (ValueError, "key_index", lambda: call(*bsnd(n1=4, n2=3))),
    "head_dim_mismatch": (ValueError, "key_index", lambda: call(q, k[..., :4], w)),
    "weights_shape": (ValueError, "weights", lambda: call(q, k, w[:, :3])),
    "batch_mismatch": (ValueError, "key_index", lambda: call(q, k[:1], w)),
    "layout": (ValueError, "layout", lambda: call(q, k, w, layout="BNSD")),
    "sparse_mode": (ValueError, "sparse_mode", lambda: call(q, k, w, sparse_mode=1)),
    "tnd_needs_qlen": (ValueError, "actual_seq_qlen", lambda: call(tq, tk, tw, layout="TND")),
    "tnd_needs_klen": (
        ValueError,
        "actual_seq_klen",
        lambda: call(tq, tk, tw, actual_seq_qlen=[6], layout="TND"),
    ),
    "tnd_decreasing": (
        ValueError,
        "actual_seq_qlen",
        lambda: call(
            tq, tk, tw, **dict(TND_LENS, actual_seq_qlen=[4, 3, 6], actual_seq_klen=[1, 2, 9])
        ),
    ),
    "tnd_last_not_total": (
        ValueError,
        "actual_seq_klen",
        lambda: call(tq, tk, tw, **dict(TND_LENS, actual_seq_klen=[4, 8])),
    ),
    "tnd_count_mismatch": (
        ValueError,
        "actual_seq_klen",
        lambda: call(tq, tk, tw, **dict(TND_LENS, actual_seq_klen=[9])),
    ),
    "bsnd_len_too_long": (
        ValueError,
        "actual_seq_klen",
        lambda: call(q, k, w, actual_seq_klen=[7, 8]),
    ),
    "bsnd_len_negative": (
        ValueError,
        "actual_seq_qlen",
        lambda: call(q, k, w, actual_seq_qlen=[-1, 5]),
    ),
    "bsnd_len_count": (ValueError, "actual_seq_qlen", lambda: call(q, k, w, actual_seq_qlen=[5])),
    "len_float_dtype": (
        TypeError,
        "actual_seq_qlen",
        lambda: call(q, k, w, actual_seq_qlen=torch.tensor([5.0, 5.0])),
    ),
    "len_2d": (
        ValueError,
        "actual_seq_qlen",
        lambda: call(q, k, w, actual_seq_qlen=torch.tensor([[5, 5]])),
    ),
    "len_wrong_type": (TypeError, "actual_seq_qlen", lambda: call(q, k, w, actual_seq_qlen="5")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_names_the_argument(name):
    error, argument, fn = CASES[name]
    assert_raises_named(error, argument, fn)


def test_meta_tensors_give_shapes_without_running():
    qm, km, wm = (t.to("meta") for t in bsnd(b=3, s1=11, s2=13, n1=8, n2=2))
    m, s = call(qm, km, wm)
    assert m.shape == (3, 2, 11) and m.dtype == torch.float32 and m.device.type == "meta"
