"""dense_lightning_indexer_softmax_lse against the float64 reference, on a designed grid, on
every SIMD path of this machine."""

import pytest
import torch
from comparators import assert_close
from conftest import assert_raises_named
from indexer_cases import CASES, DTYPES, TOLERANCES, make_inputs
from reference import UNBOUNDED, indexer_softmax_lse

import opmesh


def check(case, dtype, sparse_mode, cmp_ratio=1, cmp_residual_key=None, **input_options):
    q, k, w, kwargs = make_inputs(case, dtype, **input_options)
    if cmp_ratio > 1:
        kwargs.update(cmp_ratio=cmp_ratio, cmp_residual_key=cmp_residual_key)
    got_max, got_sum = opmesh.dense_lightning_indexer_softmax_lse(
        q, k, w, sparse_mode=sparse_mode, **kwargs
    )
    want_max, want_sum = indexer_softmax_lse(q, k, w, sparse_mode=sparse_mode, **kwargs)
    assert got_max.dtype == torch.float32 and got_sum.dtype == torch.float32
    atol, rtol, sum_rtol = TOLERANCES[dtype]
    assert_close(got_max, want_max, atol=atol, rtol=rtol, name="softmax_max")
    assert_close(got_sum, want_sum, atol=0.0, rtol=sum_rtol, name="softmax_sum")
    return want_max


@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_grid(case, dtype, sparse_mode, simd_level):
    check(case, dtype, sparse_mode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [CASES[2], CASES[5], CASES[7]], ids=lambda c: c.name)
def test_float32_weights_with_half_inputs(case, dtype, simd_level):
    check(case, dtype, 3, weights_float32=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_non_contiguous_inputs(case, dtype, simd_level):
    check(case, dtype, 3, non_contiguous=True)


def test_rows_that_see_nothing_are_minus_inf_zero():
    case = CASES[3]  # S1 = 111 > S2 = 17: the first 94 rows see no key under the causal mask
    q, k, w, kwargs = make_inputs(case, torch.float32)
    got_max, got_sum = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **kwargs)
    assert torch.isneginf(got_max[..., :94]).all() and (got_sum[..., :94] == 0).all()
    assert torch.isfinite(got_max[..., 94:]).all() and (got_sum[..., 94:] >= 1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nan_input_reaches_both_outputs(dtype, simd_level):
    """A NaN key poisons exactly the rows that can see it, on every path (no silent answer)."""
    q, k, w, kwargs = make_inputs(CASES[1], dtype)  # S1 = S2 = 111, causal
    k[0, 70, 0, 3] = float("nan")
    got_max, got_sum = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **kwargs)
    assert torch.isnan(got_max[..., 70:]).all() and torch.isnan(got_sum[..., 70:]).all()
    assert torch.isfinite(got_max[..., :70]).all() and torch.isfinite(got_sum[..., :70]).all()


def test_padded_rows_past_actual_length():
    case = CASES[5]  # BSND q lengths (40, 0, 17)
    q, k, w, kwargs = make_inputs(case, torch.float32)
    got_max, got_sum = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **kwargs)
    assert torch.isneginf(got_max[1]).all() and (got_sum[1] == 0).all()
    assert torch.isneginf(got_max[2, :, 17:]).all() and (got_sum[2, :, 17:] == 0).all()


def test_lengths_as_python_lists_match_tensors():
    case = CASES[7]
    q, k, w, kwargs = make_inputs(case, torch.float32)
    as_lists = dict(
        kwargs,
        actual_seq_qlen=kwargs["actual_seq_qlen"].tolist(),
        actual_seq_klen=kwargs["actual_seq_klen"].tolist(),
    )
    a = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **kwargs)
    b = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **as_lists)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_result_does_not_depend_on_thread_count():
    case = CASES[1]
    q, k, w, kwargs = make_inputs(case, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **kwargs)
        torch.set_num_threads(max(2, threads))
        many = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_empty_inputs():
    q = torch.randn(0, 4, 16)
    k = torch.randn(0, 2, 16)
    w = torch.randn(0, 4)
    m, s = opmesh.dense_lightning_indexer_softmax_lse(
        q, k, w, actual_seq_qlen=[], actual_seq_klen=[], layout="TND"
    )
    assert m.shape == (2, 0) and s.shape == (2, 0)
    q = torch.randn(2, 0, 4, 16)
    k = torch.randn(2, 5, 2, 16)
    w = torch.randn(2, 0, 4)
    m, s = opmesh.dense_lightning_indexer_softmax_lse(q, k, w)
    assert m.shape == (2, 2, 0)


def test_unknown_simd_cap_is_rejected(monkeypatch):
    monkeypatch.setenv("OPMESH_SIMD_MAX", "sse9")
    with pytest.raises(ValueError, match="OPMESH_SIMD_MAX"):
        opmesh.active_simd_level()
    q, k, w, kwargs = make_inputs(CASES[0], torch.float32)
    with pytest.raises(ValueError, match="OPMESH_SIMD_MAX"):
        opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **kwargs)


@pytest.mark.parametrize(
    "sparse_mode, pre_tokens, next_tokens",
    [(3, 0, UNBOUNDED), (3, 40, UNBOUNDED), (3, 5, 9), (0, 13, 0), (0, 70, 3), (0, UNBOUNDED, 21)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5], CASES[7]], ids=lambda c: c.name)
def test_band_pre_next_tokens(case, dtype, sparse_mode, pre_tokens, next_tokens, simd_level):
    """A band around the diagonal: d - pre_tokens <= j <= d + next_tokens (and j <= d when
    causal), every row's own range, tiles skipped and split where the band ends."""
    q, k, w, kwargs = make_inputs(case, dtype)
    band = dict(sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens)
    got_max, got_sum = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **band, **kwargs)
    want_max, want_sum = indexer_softmax_lse(q, k, w, **band, **kwargs)
    atol, rtol, sum_rtol = TOLERANCES[dtype]
    assert_close(got_max, want_max, atol=atol, rtol=rtol, name="softmax_max")
    assert_close(got_sum, want_sum, atol=0.0, rtol=sum_rtol, name="softmax_sum")


@pytest.mark.parametrize("name", ["pre_tokens", "next_tokens"])
def test_negative_band_is_named(name):
    q, k, w, kwargs = make_inputs(CASES[1], torch.float32)
    assert_raises_named(
        ValueError,
        name,
        lambda: opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **{name: -1}, **kwargs),
    )


# Compressed keys (DeepSeek-V4): each key entry stands for cmp_ratio original tokens; under the
# causal mask a query sees the entries whose last original token is at or before its position.
COMPRESSED = [
    (CASES[3], 4, (1,)),  # 111 queries over 17 entries (69 original tokens)
    (CASES[5], 3, (2, 0, 1)),  # lengths with empty sequences
    (CASES[7], 2, (1, 0, 1, 0)),  # TND varlen
    (CASES[8], 8, (7, 3)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case, ratio, residuals", COMPRESSED, ids=lambda c: getattr(c, "name", ""))
def test_compressed_keys(case, ratio, residuals, dtype, simd_level):
    check(case, dtype, 3, cmp_ratio=ratio, cmp_residual_key=list(residuals))
    check(case, dtype, 3, cmp_ratio=ratio)  # residuals 0


def test_compressed_keys_errors_are_named():
    q, k, w, kwargs = make_inputs(CASES[5], torch.float32)
    call = opmesh.dense_lightning_indexer_softmax_lse
    for name, extra in [
        ("cmp_residual_key", dict(cmp_ratio=3, cmp_residual_key=[3, 0, 0])),
        ("cmp_residual_key", dict(cmp_residual_key=[0, 0, 0])),
        ("cmp_residual_key", dict(cmp_ratio=3, cmp_residual_key=[0, 0])),
        ("cmp_ratio", dict(cmp_ratio=0)),
        ("pre_tokens", dict(cmp_ratio=3, pre_tokens=4)),
    ]:
        assert_raises_named(ValueError, name, lambda e=extra: call(q, k, w, **kwargs, **e))
