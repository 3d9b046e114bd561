"""lightning_indexer against the float64 reference on a designed grid (layouts BSND, TND and paged
keys under both query layouts, masks and bands, GQA, awkward sizes, K beyond the visible keys,
empty sequences), on every SIMD path; graph mode and errors.

Two kinds of check: inputs of small integers make every score exact in every dtype, so the
selection, its order and its ties must equal the reference bit for bit; normal inputs are
checked up to the float32 rounding of the scores (a near tie may pick either key, but nothing
selected may score below something left out by more than the tolerance)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from conftest import assert_raises_named
from reference import lightning_indexer as reference
from reference import lightning_indexer_scores

import opmesh

OP = torch.ops.opmesh.lightning_indexer.default


@dataclass(frozen=True)
class Case:
    name: str
    layout_query: str
    layout_key: str
    batch: int
    s1: int  # BSND: S1 (TND: from q_lengths)
    s2: int  # BSND: S2 (TND and paged: from k_lengths)
    n1: int
    n2: int
    d: int
    k: int
    q_lengths: tuple[int, ...] | None = None
    k_lengths: tuple[int, ...] | None = None
    block_size: int = 0


CASES = [
    Case("decode", "BSND", "BSND", 3, 1, 130, 8, 1, 16, 32),
    Case("square_111", "BSND", "BSND", 1, 111, 111, 16, 2, 64, 17),
    Case("more_queries", "BSND", "BSND", 1, 111, 17, 4, 1, 16, 8),
    Case("lengths", "BSND", "BSND", 3, 40, 70, 8, 2, 16, 9, (40, 0, 17), (70, 5, 0)),
    Case("k_beyond_visible", "BSND", "BSND", 2, 5, 30, 2, 2, 7, 100),
    Case("varlen", "TND", "TND", 4, 0, 0, 8, 2, 16, 16, (17, 0, 111, 1), (17, 3, 111, 40)),
    Case("paged", "BSND", "PA_BSND", 3, 4, 0, 4, 1, 32, 64, None, (150, 1, 77), 16),
    Case("paged_tnd", "TND", "PA_BSND", 3, 0, 0, 4, 1, 32, 64, (1, 1, 7), (150, 1, 77), 5),
    Case("long_k", "BSND", "BSND", 1, 2, 1000, 2, 1, 8, 300),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def make_inputs(case: Case, dtype, *, integer=False, non_contiguous=False, seed=0):
    """(query, key, weights, kwargs). Integer inputs: entries in {-2..2}, weights halves."""
    g = torch.Generator().manual_seed(seed)
    tnd = case.layout_query == "TND"
    kwargs = dict(layout_query=case.layout_query, layout_key=case.layout_key, sparse_count=case.k)
    if tnd:
        t1 = sum(case.q_lengths)
        q_shape, w_shape = (t1, case.n1, case.d), (t1, case.n1)
        kwargs["actual_seq_lengths_query"] = torch.tensor(
            list(itertools.accumulate(case.q_lengths)), dtype=torch.int32
        )
    else:
        q_shape, w_shape = (case.batch, case.s1, case.n1, case.d), (case.batch, case.s1, case.n1)
        if case.q_lengths is not None:
            kwargs["actual_seq_lengths_query"] = torch.tensor(case.q_lengths)
    if case.layout_key == "PA_BSND":
        per_seq = [-(-n // case.block_size) + 1 for n in case.k_lengths]
        blocks = sum(per_seq) + 2
        order = torch.randperm(blocks, generator=g)
        width = max(per_seq)
        table = torch.zeros(case.batch, width, dtype=torch.int32)
        used = 0
        for b, n in enumerate(per_seq):
            table[b, :n] = order[used : used + n]
            used += n
        kwargs["block_table"] = table
        kwargs["actual_seq_lengths_key"] = torch.tensor(case.k_lengths, dtype=torch.int32)
        k_shape = (blocks, case.block_size, case.n2, case.d)
    elif case.layout_key == "TND":
        kwargs["actual_seq_lengths_key"] = torch.tensor(list(itertools.accumulate(case.k_lengths)))
        k_shape = (sum(case.k_lengths), case.n2, case.d)
    else:
        k_shape = (case.batch, case.s2, case.n2, case.d)
        if case.k_lengths is not None:
            kwargs["actual_seq_lengths_key"] = torch.tensor(case.k_lengths, dtype=torch.int32)

    def draw(shape):
        if integer:
            return torch.randint(-2, 3, shape, generator=g).to(torch.float64)
        return torch.randn(shape, generator=g, dtype=torch.float64)

    q, k = draw(q_shape), draw(k_shape)
    w = draw(w_shape) * 0.5 if integer else draw(w_shape) * (case.n1 * case.d) ** -0.5
    q, k, w = q.to(dtype), k.to(dtype), w.to(dtype)
    if non_contiguous:
        q = torch.cat([q, q], dim=-1)[..., ::2]
        k = k.transpose(-3, -2).contiguous().transpose(-3, -2)
        w = torch.stack([w, w], dim=-1)[..., 0]
        assert not q.is_contiguous()
    return q, k, w, kwargs


def rows_view(t: torch.Tensor, layout_query: str) -> torch.Tensor:
    return t if layout_query == "TND" else t.flatten(0, 1)


def check_exact(case, q, k, w, kwargs):
    indices, values = opmesh.lightning_indexer(q, k, w, return_value=True, **kwargs)
    want_i, want_v = reference(q, k, w, **kwargs)
    assert indices.dtype == torch.int32 and values.dtype == torch.float32
    assert torch.equal(rows_view(indices, case.layout_query).long(), want_i)
    assert torch.equal(rows_view(values, case.layout_query).double(), want_v)


def check_close(case, q, k, w, kwargs, tol):
    """Up to rounding: the selection is a valid top-K of the float64 scores."""
    indices, values = opmesh.lightning_indexer(q, k, w, return_value=True, **kwargs)
    indices = rows_view(indices, case.layout_query).long()
    values = rows_view(values, case.layout_query).double()
    scores, visible = lightning_indexer_scores(q, k, w, **kwargs)
    count = visible.sum(-1).clamp(max=case.k)
    taken = indices >= 0
    # Exactly min(K, visible) entries, first in each row, distinct, each visible.
    assert torch.equal(taken.sum(-1), count)
    assert torch.equal(taken, torch.arange(case.k) < count[..., None])
    safe = indices.clamp(min=0)
    if scores.shape[-1] == 0:
        assert not taken.any()
        return
    assert torch.gather(visible, -1, safe)[taken].all()
    sorted_idx = safe.masked_fill(~taken, -1).sort(-1).values
    assert not ((sorted_idx[..., 1:] == sorted_idx[..., :-1]) & (sorted_idx[..., 1:] >= 0)).any()
    # Returned values are the scores of the returned keys, in descending order.
    chosen = torch.gather(scores, -1, safe)
    assert torch.allclose(values[taken], chosen[taken], atol=tol, rtol=tol)
    assert torch.isneginf(values[~taken]).all()
    assert (values[..., 1:][taken[..., 1:]] <= values[..., :-1][taken[..., 1:]]).all()
    # Nothing left out scores above the lowest selected by more than the tolerance.
    lowest = chosen.masked_fill(~taken, float("inf")).amin(-1)
    left_out = scores.clone()
    left_out.scatter_(-1, safe, float("-inf"))
    left_out = left_out.masked_fill(~visible, float("-inf")).amax(-1)
    full = count == case.k
    assert (left_out[full] <= lowest[full] + tol * (1 + lowest[full].abs())).all()


@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_grid_exact_on_integer_inputs(case, dtype, sparse_mode):
    q, k, w, kwargs = make_inputs(case, dtype, integer=True)
    check_exact(case, q, k, w, dict(kwargs, sparse_mode=sparse_mode))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_kernel_path_exact(case, dtype, simd_level):
    q, k, w, kwargs = make_inputs(case, dtype, integer=True, seed=1)
    check_exact(case, q, k, w, kwargs)


# float32 accumulation over D and the head group; the reference reads the same rounded inputs.
TOLERANCE = {torch.float32: 3e-5, torch.bfloat16: 3e-5, torch.float16: 3e-5, torch.float64: 5e-5}


@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_grid_normal_inputs(case, dtype, sparse_mode):
    q, k, w, kwargs = make_inputs(case, dtype)
    check_close(case, q, k, w, dict(kwargs, sparse_mode=sparse_mode), TOLERANCE[dtype])


@pytest.mark.parametrize("band", [(0, 0), (5, 0), (7, 3), (0, 200)])
@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5], CASES[7]], ids=lambda c: c.name)
def test_bands(case, sparse_mode, band):
    q, k, w, kwargs = make_inputs(case, torch.float32, integer=True)
    pre, nxt = band
    check_exact(
        case, q, k, w, dict(kwargs, sparse_mode=sparse_mode, pre_tokens=pre, next_tokens=nxt)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_non_contiguous_inputs_and_float32_weights(case, dtype, simd_level):
    q, k, w, kwargs = make_inputs(case, dtype, integer=True, non_contiguous=True, seed=2)
    check_exact(case, q, k, w.float(), kwargs)


def test_same_bits_for_any_thread_count():
    case = Case("threads", "BSND", "BSND", 2, 300, 700, 8, 2, 32, 64)
    q, k, w, kwargs = make_inputs(case, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = opmesh.lightning_indexer(q, k, w, return_value=True, **kwargs)
        torch.set_num_threads(max(2, threads))
        many = opmesh.lightning_indexer(q, k, w, return_value=True, **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_rows_past_a_length_and_rows_that_see_nothing_are_minus_one():
    case = CASES[3]  # lengths (40, 0, 17) of S1 = 40, keys (70, 5, 0)
    q, k, w, kwargs = make_inputs(case, torch.float32)
    indices, values = opmesh.lightning_indexer(q, k, w, return_value=True, **kwargs)
    assert (indices[1] == -1).all() and (indices[2] == -1).all()  # no query rows / no keys
    assert (indices[0, :, :, 0] >= 0).all() and torch.isneginf(values[1]).all()
    assert indices.shape == (3, 40, 2, 9) and values.shape == (3, 40, 2, 9)


@pytest.mark.parametrize("scale", [0.125, 0.3, 7.0])
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6]], ids=lambda c: c.name)
def test_scale_value_scales_the_values_and_keeps_the_selection(case, scale):
    """The selection ranks the unscaled scores; the values are scale_value times them (in
    float32: exactly for a power of two, to one rounding otherwise)."""
    q, k, w, kwargs = make_inputs(case, torch.float32, integer=True)
    indices, values = opmesh.lightning_indexer(q, k, w, return_value=True, **kwargs)
    got_i, got_v = opmesh.lightning_indexer(q, k, w, return_value=True, scale_value=scale, **kwargs)
    assert torch.equal(got_i, indices)
    want_i, want_v = reference(q, k, w, **kwargs)
    assert torch.equal(rows_view(got_i, case.layout_query).long(), want_i)
    taken = want_i >= 0
    got_v = rows_view(got_v, case.layout_query).double()
    assert torch.isneginf(got_v[~taken]).all()
    torch.testing.assert_close(got_v[taken], scale * want_v[taken], rtol=1e-7, atol=0)
    if scale == 0.125:
        assert torch.equal(got_v, rows_view(values, case.layout_query).double() * scale)


def test_without_return_value_the_values_are_empty():
    q, k, w, kwargs = make_inputs(CASES[0], torch.float32)
    indices, values = opmesh.lightning_indexer(q, k, w, **kwargs)
    assert indices.shape == (3, 1, 1, 32) and values.shape == (0,)


def test_nan_score_ranks_first():
    q, k, w, kwargs = make_inputs(CASES[0], torch.float32)
    k[0, 17, 0, 3] = float("nan")
    indices, values = opmesh.lightning_indexer(q, k, w, return_value=True, **kwargs)
    assert indices[0, 0, 0, 0] == 17 and torch.isnan(values[0, 0, 0, 0])
    assert not torch.isnan(values[0, 0, 0, 1:]).any()


def test_outputs_are_not_differentiable():
    q, k, w, kwargs = make_inputs(CASES[0], torch.float32)
    q.requires_grad_(True)
    w.requires_grad_(True)
    indices, values = opmesh.lightning_indexer(q, k, w, return_value=True, **kwargs)
    assert not indices.requires_grad and not values.requires_grad


def test_lists_are_accepted_for_lengths_and_block_table():
    case = CASES[6]
    q, k, w, kwargs = make_inputs(case, torch.float32, integer=True)
    listed = dict(
        kwargs,
        block_table=kwargs["block_table"].tolist(),
        actual_seq_lengths_key=kwargs["actual_seq_lengths_key"].tolist(),
    )
    got = opmesh.lightning_indexer(q, k, w, **listed)[0]
    assert torch.equal(got, opmesh.lightning_indexer(q, k, w, **kwargs)[0])


# Graph mode.


@pytest.mark.parametrize("case", [CASES[3], CASES[5], CASES[6], CASES[7]], ids=lambda c: c.name)
@pytest.mark.parametrize("return_value", [False, True])
def test_opcheck(case, return_value):
    q, k, w, kwargs = make_inputs(case, torch.bfloat16)
    torch.library.opcheck(OP, (q, k, w), dict(kwargs, return_value=return_value))


def _indexer(q, k, w, ql, kl, table, layout_query, layout_key, sparse_count):
    return opmesh.lightning_indexer(
        q,
        k,
        w,
        actual_seq_lengths_query=ql,
        actual_seq_lengths_key=kl,
        block_table=table,
        layout_query=layout_query,
        layout_key=layout_key,
        sparse_count=sparse_count,
        return_value=True,
    )


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    "layouts", [("BSND", "BSND"), ("TND", "TND"), ("BSND", "PA_BSND")], ids=str
)
def test_compile_fullgraph_equals_eager_with_new_shapes(layouts, dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(_indexer, fullgraph=True, dynamic=dynamic)
    cases = [c for c in CASES if (c.layout_query, c.layout_key) == layouts]
    if layouts == ("BSND", "PA_BSND"):
        cases.append(Case("paged_2", "BSND", "PA_BSND", 2, 3, 0, 4, 1, 32, 64, None, (40, 90), 8))
    for case in cases[:3]:
        q, k, w, kwargs = make_inputs(case, torch.float32)
        args = (
            q,
            k,
            w,
            kwargs.get("actual_seq_lengths_query"),
            kwargs.get("actual_seq_lengths_key"),
            kwargs.get("block_table"),
            case.layout_query,
            case.layout_key,
            case.k,
        )
        want, got = _indexer(*args), compiled(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), case.name


def test_export_with_a_dynamic_sequence_length():
    class Indexer(torch.nn.Module):
        def forward(self, q, k, w):
            return opmesh.lightning_indexer(q, k, w, sparse_count=16, return_value=True)

    case = Case("export", "BSND", "BSND", 2, 40, 70, 8, 2, 16, 16)
    q, k, w, _ = make_inputs(case, torch.float32)
    s1, s2 = torch.export.Dim("s1", min=2), torch.export.Dim("s2", min=2)
    program = torch.export.export(Indexer(), (q, k, w), dynamic_shapes=({1: s1}, {1: s2}, {1: s1}))
    other = make_inputs(Case("other", "BSND", "BSND", 2, 23, 101, 8, 2, 16, 16), torch.float32)
    for q2, k2, w2 in [(q, k, w), other[:3]]:
        got = program.module()(q2, k2, w2)
        want = Indexer()(q2, k2, w2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# Compressed keys (cmp_ratio): DeepSeek-V4's indexer over compressed key entries.


def _residuals(case, ratio, kind):
    """Per-sequence residuals: none, all zero, or varying (every value in [0, ratio) used)."""
    if kind is None:
        return None
    batch = len(case.q_lengths) if case.layout_query == "TND" else case.batch
    if kind == "zero":
        return [0] * batch
    return [(3 * b + 1) % ratio for b in range(batch)]


@pytest.mark.parametrize("residual", [None, "zero", "varying"])
@pytest.mark.parametrize("ratio", [2, 4, 7])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compressed_keys_exact_on_integer_inputs(case, ratio, residual):
    q, k, w, kwargs = make_inputs(case, torch.float32, integer=True)
    kwargs = dict(kwargs, sparse_mode=3, cmp_ratio=ratio)
    kwargs["cmp_residual_key"] = _residuals(case, ratio, residual)
    check_exact(case, q, k, w, kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5], CASES[7]], ids=lambda c: c.name)
def test_compressed_keys_every_kernel_path(case, dtype, simd_level):
    q, k, w, kwargs = make_inputs(case, dtype, integer=True)
    kwargs = dict(kwargs, sparse_mode=3, cmp_ratio=4)
    kwargs["cmp_residual_key"] = _residuals(case, 4, "varying")
    check_exact(case, q, k, w, kwargs)


def test_compressed_keys_follow_the_original_positions():
    """A decode step of 10 original key tokens compressed 4 to 1 (2 entries, residual 2): the
    token at position 9 sees both entries (tokens 0-3 and 4-7); a prefill of those 10 tokens
    sees entry 0 from position 3 and entry 1 from position 7."""
    q, k, w = torch.ones(1, 10, 1, 4), torch.ones(1, 2, 1, 4), torch.ones(1, 10, 1)
    got = opmesh.lightning_indexer(q, k, w, sparse_count=2, cmp_ratio=4, cmp_residual_key=[2])[0]
    seen = (got[0, :, 0] >= 0).sum(-1).tolist()
    assert seen == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    one = opmesh.lightning_indexer(
        q[:, -1:], k, w[:, -1:], sparse_count=2, cmp_ratio=4, cmp_residual_key=[2]
    )[0]
    assert (one[0, 0, 0] >= 0).sum().item() == 2
    # sparse_mode=0 sees every entry whatever the ratio.
    every = opmesh.lightning_indexer(q, k, w, sparse_count=2, sparse_mode=0, cmp_ratio=4)[0]
    assert (every >= 0).all()


# Errors: each names its argument at the start of the message.


def _base():
    return make_inputs(CASES[6], torch.float32)  # paged keys, BSND queries


ERRORS = [
    ("sparse_count", ValueError, lambda kw: dict(kw, sparse_count=0)),
    ("sparse_count", ValueError, lambda kw: dict(kw, sparse_count=65537)),
    ("sparse_mode", ValueError, lambda kw: dict(kw, sparse_mode=1)),
    ("pre_tokens", ValueError, lambda kw: dict(kw, pre_tokens=-1)),
    ("layout_query", ValueError, lambda kw: dict(kw, layout_query="BNSD")),
    ("layout_key", ValueError, lambda kw: dict(kw, layout_key="PA_BBND")),
    ("block_table", ValueError, lambda kw: {**kw, "block_table": None}),
    ("block_table", ValueError, lambda kw: {**kw, "block_table": kw["block_table"][:2]}),
    ("block_table", ValueError, lambda kw: {**kw, "block_table": kw["block_table"] + 100}),
    ("block_table", ValueError, lambda kw: {**kw, "block_table": kw["block_table"][:, :2]}),
    ("block_table", TypeError, lambda kw: {**kw, "block_table": kw["block_table"].float()}),
    ("actual_seq_lengths_key", ValueError, lambda kw: {**kw, "actual_seq_lengths_key": None}),
    ("actual_seq_lengths_key", ValueError, lambda kw: {**kw, "actual_seq_lengths_key": [5, -1, 3]}),
    ("actual_seq_lengths_query", ValueError, lambda kw: dict(kw, actual_seq_lengths_query=[5, 1])),
    ("actual_seq_lengths_query", TypeError, lambda kw: dict(kw, actual_seq_lengths_query=[1.5, 1])),
    ("scale_value", ValueError, lambda kw: dict(kw, scale_value=0.0)),
    ("scale_value", ValueError, lambda kw: dict(kw, scale_value=-0.5)),
    ("scale_value", ValueError, lambda kw: dict(kw, scale_value=float("inf"))),
    ("scale_value", ValueError, lambda kw: dict(kw, scale_value=float("nan"))),
    ("cmp_ratio", ValueError, lambda kw: dict(kw, cmp_ratio=0)),
    ("cmp_residual_key", ValueError, lambda kw: dict(kw, cmp_residual_key=[0, 1, 0])),
    ("cmp_residual_key", ValueError, lambda kw: dict(kw, cmp_ratio=4, cmp_residual_key=[0, 4, 0])),
    ("cmp_residual_key", ValueError, lambda kw: dict(kw, cmp_ratio=4, cmp_residual_key=[0, -1, 0])),
    ("cmp_residual_key", ValueError, lambda kw: dict(kw, cmp_ratio=4, cmp_residual_key=[0, 1])),
    ("cmp_residual_key", TypeError, lambda kw: dict(kw, cmp_ratio=4, cmp_residual_key=[0.5, 1, 0])),
    ("pre_tokens", ValueError, lambda kw: dict(kw, cmp_ratio=4, pre_tokens=8)),
    ("next_tokens", ValueError, lambda kw: dict(kw, cmp_ratio=4, next_tokens=8)),
]  # fmt: skip


@pytest.mark.parametrize("name,exc,edit", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_bad_arguments_name_themselves(name, exc, edit):
    q, k, w, kwargs = _base()
    bad = edit(kwargs)
    assert_raises_named(exc, name, lambda: opmesh.lightning_indexer(q, k, w, **bad))


def test_bad_tensors_name_themselves():
    q, k, w, kwargs = make_inputs(CASES[3], torch.float32)
    call = opmesh.lightning_indexer
    assert_raises_named(TypeError, "key", lambda: call(q, k.double(), w, **kwargs))
    assert_raises_named(TypeError, "weights", lambda: call(q, k, w.double(), **kwargs))
    assert_raises_named(TypeError, "query", lambda: call(q.int(), k.int(), w, **kwargs))
    assert_raises_named(ValueError, "query", lambda: call(q[0], k, w, **kwargs))
    assert_raises_named(ValueError, "key", lambda: call(q, k[..., :3], w, **kwargs))
    assert_raises_named(
        ValueError, "key", lambda: call(q, k[:, :, :1].expand(-1, -1, 3, -1), w, **kwargs)
    )
    assert_raises_named(ValueError, "key", lambda: call(q, k[:2], w, **kwargs))
    assert_raises_named(ValueError, "weights", lambda: call(q, k, w[:, :3], **kwargs))
    assert_raises_named(
        ValueError, "layout_key", lambda: call(q, k, w, **dict(kwargs, layout_key="TND"))
    )
    assert_raises_named(
        ValueError,
        "block_table",
        lambda: call(q, k, w, block_table=torch.zeros(3, 2, dtype=torch.int32)),
    )
    assert_raises_named(
        ValueError,
        "actual_seq_lengths_query",
        lambda: call(q[0], k[0], w[0], layout_query="TND", layout_key="TND"),
    )
    assert_raises_named(
        ValueError,
        "actual_seq_lengths_query",
        lambda: call(q, k, w, actual_seq_lengths_query=[1, 2]),
    )
