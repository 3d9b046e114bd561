"""sparse_flash_attention forward and backward against the float64 reference (whose autograd
gives the reference gradients) on a designed grid: layouts BSND, TND and paged keys, masks and
bands, GQA, rope, sparse block sizes 1/4/64, K beyond the visible keys, one selection for every
key head, sinks, MLA absorb, empty sequences; every SIMD path; graph mode; errors."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from conftest import assert_raises_named
from reference import sparse_flash_attention as reference

import opmesh

OP = torch.ops.opmesh.sparse_flash_attention.default
BACKWARD = torch.ops.opmesh.sparse_flash_attention_backward.default


@dataclass(frozen=True)
class Case:
    name: str
    layout_query: str
    layout_kv: str
    batch: int
    s1: int  # BSND S1 (TND: from q_lengths)
    s2: int  # BSND S2 (TND, paged: from k_lengths)
    n1: int
    n2: int
    d: int
    dv: int
    k: int
    sparse_block_size: int = 1
    q_lengths: tuple[int, ...] | None = None
    k_lengths: tuple[int, ...] | None = None
    block_size: int = 0  # paged
    rope: int = 0
    shared_selection: bool = False  # sparse_indices' key-head dim of 1
    sinks: bool = False


CASES = [
    Case("gqa", "BSND", "BSND", 2, 37, 37, 4, 2, 16, 12, 9),
    Case("decode", "BSND", "BSND", 3, 1, 130, 8, 1, 32, 32, 16, sinks=True),
    Case("rope_blocks_4", "BSND", "BSND", 1, 45, 70, 4, 1, 16, 16, 6, 4, rope=8),
    Case("lengths", "BSND", "BSND", 3, 20, 33, 2, 2, 8, 8, 40, 1, (20, 0, 7), (33, 5, 0)),
    Case("varlen", "TND", "TND", 4, 0, 0, 4, 2, 16, 8, 7, 1, (17, 0, 30, 1), (17, 3, 30, 40)),
    Case("shared_sinks", "TND", "TND", 2, 0, 0, 6, 3, 16, 16, 5, 2, (9, 20), (12, 20),
         shared_selection=True, sinks=True),
    Case("blocks_64", "BSND", "BSND", 1, 3, 300, 2, 1, 16, 16, 3, 64),
    Case("paged", "BSND", "PA_BSND", 2, 3, 0, 4, 1, 16, 16, 12, 1, None, (70, 9), 16, rope=4),
    # bf16 rows of unit stride with whole 32-column values are read where they lie on pair sets:
    # groups of 20 (a partial head vector) and 72 (two 64-head products), a rope, more than one
    # 64-key chunk with an odd last one, an empty sequence, paged rows.
    Case("in_place_rope", "BSND", "BSND", 2, 21, 150, 40, 2, 32, 64, 101, rope=16),
    Case("in_place_wide", "TND", "TND", 3, 0, 0, 72, 1, 64, 32, 67, 1, (5, 0, 9), (90, 4, 80)),
    Case("in_place_paged", "BSND", "PA_BSND", 2, 4, 0, 16, 1, 32, 32, 70, 1, None, (90, 30), 16,
         rope=2),
]  # fmt: skip
# An odd group wider than one head-pair tile (135 query heads on one key head: the key pass's
# products on bf16 pairs take 128 heads, then the rest), more than 64 selected keys per row.
# A long query: the backward takes its tokens in several spans, and each key block's gradient
# sums the tokens of every span that selects it.
LONG = Case("long_query", "BSND", "BSND", 2, 600, 640, 4, 1, 16, 16, 8, sinks=True)
WIDE = Case("wide_odd_group", "BSND", "BSND", 1, 9, 90, 135, 1, 24, 20, 70, rope=8)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def seq_bounds(case: Case):
    """(q_begin, q_len, k_len) per sequence, q_begin in output rows."""
    if case.layout_query == "TND":
        qb = [0, *itertools.accumulate(case.q_lengths)][:-1]
        return list(zip(qb, case.q_lengths, case.k_lengths, strict=True))
    q_lens = case.q_lengths or (case.s1,) * case.batch
    k_lens = case.k_lengths or (case.s2,) * case.batch
    return [(b * case.s1, q_lens[b], k_lens[b]) for b in range(case.batch)]


def make_inputs(case: Case, dtype, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    tnd = case.layout_query == "TND"
    lead_q = (sum(case.q_lengths),) if tnd else (case.batch, case.s1)
    kwargs = dict(
        layout_query=case.layout_query,
        layout_kv=case.layout_kv,
        sparse_block_size=case.sparse_block_size,
    )
    if tnd:
        kwargs["actual_seq_lengths_query"] = torch.tensor(
            list(itertools.accumulate(case.q_lengths))
        )
    elif case.q_lengths is not None:
        kwargs["actual_seq_lengths_query"] = torch.tensor(case.q_lengths)
    if case.layout_kv == "PA_BSND":
        per_seq = [-(-n // case.block_size) + 1 for n in case.k_lengths]
        blocks = sum(per_seq) + 2
        order = torch.randperm(blocks, generator=g)
        table = torch.zeros(case.batch, max(per_seq), dtype=torch.int32)
        used = 0
        for b, n in enumerate(per_seq):
            table[b, :n] = order[used : used + n]
            used += n
        kwargs["block_table"] = table
        kwargs["actual_seq_lengths_kv"] = torch.tensor(case.k_lengths, dtype=torch.int32)
        lead_k = (blocks, case.block_size)
    elif tnd:
        kwargs["actual_seq_lengths_kv"] = torch.tensor(list(itertools.accumulate(case.k_lengths)))
        lead_k = (sum(case.k_lengths),)
    else:
        lead_k = (case.batch, case.s2)
        if case.k_lengths is not None:
            kwargs["actual_seq_lengths_kv"] = torch.tensor(case.k_lengths, dtype=torch.int32)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q, k, v = (
        draw(*lead_q, case.n1, case.d),
        draw(*lead_k, case.n2, case.d),
        draw(*lead_k, case.n2, case.dv),
    )
    if case.rope:
        kwargs["query_rope"] = draw(*lead_q, case.n1, case.rope)
        kwargs["key_rope"] = draw(*lead_k, case.n2, case.rope)
    if case.sinks:
        kwargs["sinks"] = torch.randn(case.n1, generator=g)
    heads = 1 if case.shared_selection else case.n2
    rows = lead_q[0] * (1 if tnd else lead_q[1])
    idx = torch.full((rows, heads, case.k), -1, dtype=torch.int32)
    for q0, qlen, klen in seq_bounds(case):
        blocks = -(-klen // case.sparse_block_size)
        for r in range(q0, q0 + qlen):
            for n in range(heads):
                pick = torch.randperm(blocks, generator=g)[: case.k].int()
                idx[r, n, : len(pick)] = pick
                idx[r, n] = idx[r, n, torch.randperm(case.k, generator=g)]  # -1 anywhere
    idx = idx if tnd else idx.view(case.batch, case.s1, heads, case.k)
    return q, k, v, idx, kwargs


SCALE = 0.3


def rows_of(t, case):
    return t if case.layout_query == "TND" else t.flatten(0, 1)


def stats_rows(t, case):
    """[B, N2, S1, G] / [N2, T1, G] -> [R, N1]."""
    if case.layout_query == "TND":
        return t.permute(1, 0, 2).flatten(1)
    return t.permute(0, 2, 1, 3).flatten(0, 1).flatten(1)


# Forward: float32 accumulation; outputs rounded to the dtype.
FORWARD_TOL = {torch.float32: 2e-5, torch.float64: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def check_forward(case, dtype, scale=SCALE, **extra):
    q, k, v, idx, kwargs = make_inputs(case, dtype)
    kwargs.update(extra)
    out, smax, ssum = opmesh.sparse_flash_attention(
        q, k, v, idx, scale, return_softmax_lse=True, **kwargs
    )
    want, wmax, wsum = reference(q, k, v, idx, scale, **kwargs)
    assert out.dtype == dtype and out.shape == (*q.shape[:-1], case.dv)
    tol = FORWARD_TOL[dtype]
    torch.testing.assert_close(rows_of(out, case).double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(stats_rows(smax, case).double(), wmax, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(stats_rows(ssum, case).double(), wsum, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_grid(case, dtype):
    check_forward(case, dtype)


@pytest.mark.parametrize("band", [(0, 0), (6, 0), (5, 3)])
@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[7]], ids=lambda c: c.name)
def test_masks_and_bands(case, sparse_mode, band):
    check_forward(
        case, torch.float32, sparse_mode=sparse_mode, pre_tokens=band[0], next_tokens=band[1]
    )


@pytest.mark.parametrize(
    "case", [CASES[0], CASES[2], CASES[7], CASES[8], CASES[9]], ids=lambda c: c.name
)
def test_every_kernel_path(case, simd_level):
    check_forward(case, torch.float32)
    check_forward(case, torch.bfloat16)


@pytest.mark.parametrize("case", [CASES[1], CASES[9]], ids=lambda c: c.name)
def test_rows_read_in_place_give_the_packed_bits(case, simd_level):
    # Rows of unit stride are read where they lie on pair sets, rows of stride 2 are copied and
    # packed first: without a rope, the same products in the same order, forward and backward.
    q, k, v, idx, kwargs = make_inputs(case, torch.bfloat16)
    upstream = torch.randn(*q.shape[:-1], case.dv, generator=torch.Generator().manual_seed(1))

    def spread(t):
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]

    def run(strided):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        kk, vv = (spread(t) if strided else t for t in leaves[1:])
        assert (kk.stride(-1), vv.stride(-1)) == ((2, 2) if strided else (1, 1))
        outs = opmesh.sparse_flash_attention(
            leaves[0], kk, vv, idx, SCALE, return_softmax_lse=True, **kwargs
        )
        (outs[0].float() * upstream).sum().backward()
        return [t.detach() for t in outs] + [t.grad for t in leaves]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scale", [-0.2, 0.0])
def test_negative_and_zero_scale_on_every_kernel_path(scale, simd_level):
    # bf16 sets fold a positive scale into the softmax's exp; these take the product's scaling.
    for dtype in (torch.float32, torch.bfloat16):
        check_forward(CASES[2], dtype, scale=scale)


# Softcaps that bind (scores beyond them) and one that barely does; on a case with rope, blocks,
# sinks and GQA, and on paged keys.
@pytest.mark.parametrize("softcap", [0.3, 2.0, 50.0])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5], CASES[7]], ids=lambda c: c.name)
def test_softcap(case, softcap):
    for dtype in (torch.float32, torch.bfloat16):
        check_forward(case, dtype, scale=1.0, softcap=softcap)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: c.name)
def test_softcap_on_every_kernel_path(case, simd_level):
    check_forward(case, torch.float32, scale=1.0, softcap=0.5)
    check_forward(case, torch.bfloat16, scale=1.0, softcap=0.5)
    ours, ref = gradients(case, torch.bfloat16, softcap=0.5)
    for name in ours:
        tol = BACKWARD_TOL[torch.bfloat16]
        torch.testing.assert_close(ours[name].grad.double(), ref[name].grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5]], ids=lambda c: c.name)
def test_softcap_gradients(case):
    ours, ref = gradients(case, torch.float32, softcap=0.4)
    for name in ours:
        torch.testing.assert_close(ours[name].grad.double(), ref[name].grad, atol=2e-4,
                                   rtol=2e-4, msg=name)  # fmt: skip


def gradients(case, dtype, **extra):
    """The op's and the reference's gradients for the same upstream gradient."""
    q, k, v, idx, kwargs = make_inputs(case, dtype, seed=3)
    kwargs.update(extra)
    leaves = {"query": q, "key": k, "value": v}
    for name in ("query_rope", "key_rope", "sinks"):
        if kwargs.get(name) is not None:
            leaves[name] = kwargs.pop(name)
    ours = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    ref = {n: t.detach().double().requires_grad_(True) for n, t in leaves.items()}
    out = opmesh.sparse_flash_attention(
        ours["query"], ours["key"], ours["value"], idx, SCALE,
        **{n: t for n, t in ours.items() if n not in ("query", "key", "value")}, **kwargs,
    )[0]  # fmt: skip
    want = reference(
        ref["query"], ref["key"], ref["value"], idx, SCALE,
        **{n: t for n, t in ref.items() if n not in ("query", "key", "value")}, **kwargs,
    )[0]  # fmt: skip
    upstream = torch.randn(
        want.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    (rows_of(out, case).double() * upstream).sum().backward()
    (want * upstream).sum().backward()
    return ours, ref


# Backward: float32 sums over the selected keys and tokens; gradients rounded to the dtype.
BACKWARD_TOL = {torch.float32: 2e-4, torch.float64: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "case", [c for c in CASES if c.layout_kv != "PA_BSND"] + [LONG], ids=lambda c: c.name
)
def test_gradients(case, dtype):
    ours, ref = gradients(case, dtype)
    tol = BACKWARD_TOL[dtype]
    for name in ours:
        got, want = ours[name].grad, ref[name].grad
        assert got is not None and got.dtype == ours[name].dtype, name
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], WIDE], ids=lambda c: c.name)
def test_gradients_on_every_kernel_path(case, simd_level):
    ours, ref = gradients(case, torch.bfloat16)
    for name in ours:
        tol = BACKWARD_TOL[torch.bfloat16]
        torch.testing.assert_close(ours[name].grad.double(), ref[name].grad, atol=tol, rtol=tol)


def test_mla_absorb_key_is_value():
    case = Case("mla", "BSND", "BSND", 1, 20, 20, 8, 1, 24, 24, 6, rope=8)
    q, k, _, idx, kwargs = make_inputs(case, torch.float32)
    kv = k.clone().requires_grad_(True)
    out = opmesh.sparse_flash_attention(q, kv, kv, idx, SCALE, attention_mode=2, **kwargs)[0]
    out.sum().backward()
    kv_ref = k.double().requires_grad_(True)
    want = reference(q, kv_ref, kv_ref, idx, SCALE, **kwargs)[0]
    want.sum().backward()
    torch.testing.assert_close(out.flatten(0, 1).double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kv.grad.double(), kv_ref.grad, atol=2e-4, rtol=2e-4)
    call = opmesh.sparse_flash_attention
    copy = k.clone()
    assert_raises_named(
        ValueError, "value", lambda: call(q, k, copy, idx, SCALE, attention_mode=2, **kwargs)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "case",
    [Case("threads", "BSND", "BSND", 2, 100, 150, 4, 2, 32, 32, 24, 2, rope=8, sinks=True), LONG],
    ids=lambda c: c.name,
)
def test_same_bits_for_any_thread_count(case, dtype):
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            ours, _ = gradients(case, dtype)
            results.append({name: t.grad for name, t in ours.items()})
    finally:
        torch.set_num_threads(threads)
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_rows_that_select_nothing_and_rows_past_a_length():
    case = CASES[3]  # lengths (20, 0, 7) of S1 = 20, keys (33, 5, 0)
    q, k, v, idx, kwargs = make_inputs(case, torch.float32)
    idx[0, 4] = -1  # row (0, 4) selects nothing
    out, smax, ssum = opmesh.sparse_flash_attention(
        q, k, v, idx, SCALE, return_softmax_lse=True, **kwargs
    )
    assert (out[0, 4] == 0).all() and (out[1] == 0).all() and (out[2] == 0).all()
    assert torch.isneginf(smax[0, :, 4]).all() and (ssum[0, :, 4] == 0).all()
    assert torch.isneginf(smax[2]).all()


def test_paged_backward_is_refused():
    case = CASES[7]
    q, k, v, idx, kwargs = make_inputs(case, torch.float32)
    q.requires_grad_(True)
    out = opmesh.sparse_flash_attention(q, k, v, idx, SCALE, **kwargs)[0]
    assert_raises_named(ValueError, "layout_kv", lambda: out.sum().backward())


def test_statistics_are_not_differentiable():
    q, k, v, idx, kwargs = make_inputs(CASES[0], torch.float32)
    q.requires_grad_(True)
    out, smax, ssum = opmesh.sparse_flash_attention(
        q, k, v, idx, SCALE, return_softmax_lse=True, **kwargs
    )
    assert out.requires_grad and not smax.requires_grad and not ssum.requires_grad


# Graph mode.


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[5], CASES[7]], ids=lambda c: c.name)
def test_opcheck(case):
    q, k, v, idx, kwargs = make_inputs(case, torch.float32)
    torch.library.opcheck(OP, (q, k, v, idx, SCALE), dict(kwargs, return_softmax_lse=True))
    if case.layout_kv == "PA_BSND":
        return
    out, smax, ssum = OP(q, k, v, idx, SCALE, return_softmax_lse=True, **kwargs)
    args = (torch.randn_like(out), q, k, v, idx, out, smax, ssum, SCALE)
    torch.library.opcheck(BACKWARD, args, kwargs)


def _attention(q, k, v, idx, ql, kl, layout):
    return opmesh.sparse_flash_attention(
        q, k, v, idx, SCALE, actual_seq_lengths_query=ql, actual_seq_lengths_kv=kl,
        layout_query=layout, layout_kv=layout, return_softmax_lse=True,
    )  # fmt: skip


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_compile_fullgraph_forward_and_backward_equal_eager(layout, dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(_attention, fullgraph=True, dynamic=dynamic)
    # Two or more shapes per layout (the later calls bring new sizes and lengths); the indices
    # of a case with sparse blocks still name valid keys when read as single keys.
    same = [c for c in CASES if c.layout_query == layout and c.layout_kv == layout]
    cases = [c for c in same if not c.rope][:3]
    assert len(cases) >= 2
    for case in cases:
        q, k, v, idx, kwargs = make_inputs(case, torch.float32)
        ql, kl = kwargs.get("actual_seq_lengths_query"), kwargs.get("actual_seq_lengths_kv")
        grads = []
        for fn in (_attention, compiled):
            qq = q.clone().requires_grad_(True)
            out = fn(qq, k, v, idx, ql, kl, layout)
            out[0].square().sum().backward()
            grads.append((out, qq.grad))
        (want, want_dq), (got, got_dq) = grads
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), case.name
        assert torch.equal(got_dq, want_dq), case.name


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_mla_absorb_equals_eager(dynamic, training):
    """Key and value as one tensor (attention_mode=2) under Inductor, whose inference graph hands
    the shape function the two arguments as two fakes without data: the same bits as eager,
    gradients included when training."""
    case = Case("mla", "BSND", "BSND", 1, 20, 20, 8, 1, 24, 24, 6, rope=8)
    q, k, _, idx, kwargs = make_inputs(case, torch.float32)

    def absorb(q, k, v, idx):  # called with v = k, as a model passes its latent cache twice
        return opmesh.sparse_flash_attention(q, k, v, idx, SCALE, attention_mode=2, **kwargs)[0]

    torch._dynamo.reset()
    compiled = torch.compile(absorb, fullgraph=True, dynamic=dynamic)
    results = []
    for fn in (absorb, compiled):
        qq, kv = q.clone().requires_grad_(training), k.clone().requires_grad_(training)
        out = fn(qq, kv, kv, idx)
        if training:
            out.square().sum().backward()
        results.append((out, qq.grad, kv.grad))
    for a, b in zip(*results, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_export_with_a_dynamic_sequence_length():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v, idx):
            return opmesh.sparse_flash_attention(q, k, v, idx, SCALE)[0]

    case = Case("export", "BSND", "BSND", 2, 30, 40, 4, 2, 16, 16, 8)
    q, k, v, idx, _ = make_inputs(case, torch.float32)
    s1, s2 = torch.export.Dim("s1", min=2), torch.export.Dim("s2", min=8)
    program = torch.export.export(
        Attention(), (q, k, v, idx), dynamic_shapes=({1: s1}, {1: s2}, {1: s2}, {1: s1})
    )
    other = make_inputs(Case("other", "BSND", "BSND", 2, 23, 51, 4, 2, 16, 16, 8), torch.float32)
    for args in [(q, k, v, idx), other[:4]]:
        assert torch.equal(program.module()(*args), Attention()(*args))


# Errors: each names its argument at the start of the message.


def _bad_index(value, where=(0, 3, 0, 2)):
    def edit(idx):
        idx = idx.clone()
        idx[where] = value
        return idx

    return edit


def test_bad_sparse_indices_name_the_row():
    q, k, v, idx, kwargs = make_inputs(CASES[0], torch.float32)
    call = opmesh.sparse_flash_attention
    for value in (-2, 37):
        bad = _bad_index(value)(idx)
        err = assert_raises_named(
            ValueError, "sparse_indices", lambda bad=bad: call(q, k, v, bad, SCALE, **kwargs)
        )
        assert "row [0, 3, 0]" in str(err)
    twice = idx.clone()
    twice[0, 3, 0, 1] = twice[0, 3, 0, 0] = 5
    err = assert_raises_named(
        ValueError, "sparse_indices", lambda: call(q, k, v, twice, SCALE, **kwargs)
    )
    assert "twice" in str(err)


def test_bad_arguments_name_themselves():
    q, k, v, idx, kwargs = make_inputs(CASES[2], torch.float32)  # rope, sparse blocks of 4
    call = opmesh.sparse_flash_attention

    def run(q=q, k=k, v=v, idx=idx, scale=SCALE, **changes):
        return call(q, k, v, idx, scale, **{**kwargs, **changes})

    cases = [
        (TypeError, "key", lambda: run(k=k.double())),
        (TypeError, "sparse_indices", lambda: run(idx=idx.float())),
        (ValueError, "value", lambda: run(v=v[:, :, :1].expand(-1, -1, 3, -1))),
        (ValueError, "key", lambda: run(k=k[..., :5])),
        (ValueError, "sparse_indices", lambda: run(idx=idx[:, :3])),
        (ValueError, "key_rope", lambda: run(key_rope=None)),
        (ValueError, "query_rope", lambda: run(query_rope=None)),
        (ValueError, "attention_mode", lambda: run(attention_mode=1)),
        (ValueError, "sparse_block_size", lambda: run(sparse_block_size=0)),
        (ValueError, "layout_kv", lambda: run(layout_kv="TND")),
        (ValueError, "sinks", lambda: run(sinks=torch.zeros(3))),
        (ValueError, "scale_value", lambda: run(scale=float("nan"))),
        (ValueError, "block_table", lambda: run(block_table=[[0]])),
        (ValueError, "sparse_mode", lambda: run(sparse_mode=4)),
        (ValueError, "softcap", lambda: run(softcap=-1.0)),
        (ValueError, "softcap", lambda: run(softcap=float("inf"))),
        (ValueError, "softcap", lambda: run(softcap=float("nan"))),
    ]
    for exc, name, fn in cases:
        assert_raises_named(exc, name, fn)
