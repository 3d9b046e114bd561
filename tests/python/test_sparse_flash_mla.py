"""sparse_flash_mla forward and backward against the float64 reference (whose autograd gives the
reference gradients) on a designed grid: SWA (a window of ori_kv), HCA (every compressed entry
a row may see, residuals), CSA (a top-k of the compressed entries with -1 and topk lengths), an
ori-side selection, cmp_kv alone; BSND, TND and paged keys; GQA, awkward head dims, sinks,
uneven and empty sequences, rows that see nothing and rows past a length; every kernel path;
gradcheck; graph mode; errors."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from conftest import assert_raises_named
from reference import sparse_flash_mla as reference

import opmesh

OP = torch.ops.opmesh.sparse_flash_mla.default
BACKWARD = torch.ops.opmesh.sparse_flash_mla_backward.default


@dataclass(frozen=True)
class Case:
    name: str
    layout_q: str
    layout_kv: str
    n1: int
    n2: int
    d: int
    q_lens: tuple[int, ...]
    ori_lens: tuple[int, ...] | None  # None: no ori_kv
    cmp_lens: tuple[int, ...] | None = None  # None: no cmp_kv (SWA)
    s1: int = 0  # BSND padded lengths (0: the longest)
    s_ori: int = 0
    s_cmp: int = 0
    cmp_ratio: int = 1
    residuals: tuple[int, ...] | None = None
    win: tuple[int, int] = (-1, -1)
    ori_mask_mode: int = 4
    cmp_mask_mode: int = 3
    topk: int = 0  # CSA: K of cmp_sparse_indices
    ori_topk: int = 0  # K of ori_sparse_indices
    topk_length: bool = False
    block_size: int = 0  # paged
    sinks: bool = False


CASES = [
    Case("swa", "BSND", "BSND", 4, 1, 24, (13, 13), (13, 13), win=(5, 0), sinks=True),
    Case("hca_gqa", "BSND", "BSND", 4, 2, 16, (9, 9), (9, 9), (2, 2), cmp_ratio=4,
         residuals=(1, 1), win=(3, 0)),
    Case("csa_tnd", "TND", "TND", 6, 2, 20, (7, 0, 12), (7, 0, 12), (3, 0, 6), cmp_ratio=2,
         residuals=(1, 0, 0), win=(4, 0), topk=4, topk_length=True, sinks=True),
    Case("decode_paged_hca", "BSND", "PA_BBND", 8, 1, 32, (1, 1, 1), (40, 9, 1), (10, 2, 0),
         cmp_ratio=4, residuals=(0, 1, 1), win=(15, 0), block_size=8, sinks=True),
    Case("csa_tnd_paged", "TND", "PA_BBND", 4, 1, 16, (2, 3), (21, 3), (5, 0), cmp_ratio=4,
         residuals=(1, 3), win=(7, 0), topk=8, block_size=4),
    Case("ori_selection", "BSND", "BSND", 2, 1, 8, (6, 6), (10, 10), ori_mask_mode=0,
         ori_topk=5, topk_length=True),
    Case("lengths_past", "BSND", "BSND", 4, 2, 12, (5, 0, 3), (8, 2, 0), (2, 1, 0), s1=6,
         s_ori=9, s_cmp=3, cmp_ratio=3, residuals=(2, 0, 0), ori_mask_mode=3, sinks=True),
    Case("cmp_only", "TND", "TND", 3, 1, 40, (10, 4), None, (3, 1), cmp_ratio=3,
         residuals=(1, 1)),
    Case("hca_ratio_1", "BSND", "BSND", 2, 1, 8, (7,), (7,), (7,), cmp_ratio=1, win=(2, 1)),
]  # fmt: skip
# Long sequences over few compressed entries, more tokens than one span of the backward (1024):
# key blocks of the window and of the compressed entries reach tokens of both spans, and each
# block sums them in order across the spans.
LONG = Case("hca_long", "TND", "TND", 4, 1, 16, (700, 400), (700, 400), (21, 12), cmp_ratio=32,
            residuals=(28, 12), win=(7, 0), sinks=True)  # fmt: skip
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SCALE = 0.3


def _lengths(lens):
    return torch.tensor(lens, dtype=torch.int32)


def _cumulative(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def _keys(case, lens, padded, draw, gen, kwargs, side):
    """One key tensor in the case's layout, its lengths and (paged) block table."""
    if case.layout_kv == "PA_BBND":
        per_seq = [-(-n // case.block_size) + 1 for n in lens]
        blocks = sum(per_seq) + 2
        order = torch.randperm(blocks, generator=gen)
        table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
        used = 0
        for b, n in enumerate(per_seq):
            table[b, :n] = order[used : used + n]
            used += n
        kwargs[f"{side}_block_table"] = table
        kwargs[f"seqused_{side}_kv"] = _lengths(lens)
        return draw(blocks, case.block_size, case.n2, case.d)
    if case.layout_kv == "TND":
        kwargs[f"cu_seqlens_{side}_kv"] = _cumulative(lens)
        return draw(sum(lens), case.n2, case.d)
    s = padded or max(lens)
    if any(n != s for n in lens):
        kwargs[f"seqused_{side}_kv"] = _lengths(lens)
    return draw(len(lens), s, case.n2, case.d)


def _selection(case, lens, k, gen, q_rows):
    """[rows, N2, K] int32: distinct entries of each row's sequence, -1 anywhere."""
    idx = torch.full((q_rows, case.n2, k), -1, dtype=torch.int32)
    for r, n in enumerate(lens):
        for h in range(case.n2):
            pick = torch.randperm(max(n, 1), generator=gen)[: min(k, n)].int()
            idx[r, h, : len(pick)] = pick
            idx[r, h] = idx[r, h, torch.randperm(k, generator=gen)]
    return idx


def make_inputs(case: Case, dtype, *, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tnd = case.layout_q == "TND"
    batch = len(case.q_lens)
    kwargs = dict(layout_q=case.layout_q, layout_kv=case.layout_kv, softmax_scale=SCALE)
    kwargs.update(cmp_ratio=case.cmp_ratio, ori_mask_mode=case.ori_mask_mode)
    kwargs.update(cmp_mask_mode=case.cmp_mask_mode)
    if case.ori_mask_mode == 4:
        kwargs.update(ori_win_left=case.win[0], ori_win_right=case.win[1])

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    if tnd:
        q = draw(sum(case.q_lens), case.n1, case.d)
        kwargs["cu_seqlens_q"] = _cumulative(case.q_lens)
        row_seq = [b for b, n in enumerate(case.q_lens) for _ in range(n)]
    else:
        s1 = case.s1 or max(case.q_lens)
        q = draw(batch, s1, case.n1, case.d)
        if any(n != s1 for n in case.q_lens):
            kwargs["seqused_q"] = _lengths(case.q_lens)
        row_seq = [b for b in range(batch) for _ in range(s1)]
    if case.ori_lens is not None:
        kwargs["ori_kv"] = _keys(case, case.ori_lens, case.s_ori, draw, gen, kwargs, "ori")
    if case.cmp_lens is not None:
        kwargs["cmp_kv"] = _keys(case, case.cmp_lens, case.s_cmp, draw, gen, kwargs, "cmp")
    if case.residuals is not None:
        kwargs["cmp_residual_kv"] = _lengths(case.residuals)
    lead = q.shape[:-2]
    for side, k, lens in (("cmp", case.topk, case.cmp_lens), ("ori", case.ori_topk, case.ori_lens)):
        if not k:
            continue
        idx = _selection(case, [lens[b] for b in row_seq], k, gen, len(row_seq))
        kwargs[f"{side}_sparse_indices"] = idx.view(*lead, case.n2, k)
        if case.topk_length:
            length = torch.randint(0, k + 1, (len(row_seq), case.n2), generator=gen)
            kwargs[f"{side}_topk_length"] = length.int().view(*lead, case.n2)
    if case.sinks:
        kwargs["sinks"] = torch.randn(case.n1, generator=gen)
    return q, kwargs


def rows_of(t, case):
    return t if case.layout_q == "TND" else t.flatten(0, 1)


def lse_rows(t, case):
    """[B, N2, S1, G] / [N2, T1, G] -> [R, N1]."""
    if case.layout_q == "TND":
        return t.permute(1, 0, 2).flatten(1)
    return t.permute(0, 2, 1, 3).flatten(0, 1).flatten(1)


# Forward: float32 accumulation; outputs rounded to the dtype.
FORWARD_TOL = {torch.float32: 2e-5, torch.float64: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def check_forward(case, dtype, **extra):
    q, kwargs = make_inputs(case, dtype)
    kwargs.update(extra)
    out, lse = opmesh.sparse_flash_mla(q, return_softmax_lse=True, **kwargs)
    want, wlse = reference(q, **kwargs)
    assert out.dtype == dtype and out.shape == q.shape
    tol = FORWARD_TOL[dtype]
    torch.testing.assert_close(rows_of(out, case).double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse_rows(lse, case).double(), wlse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_grid(case, dtype):
    check_forward(case, dtype)


@pytest.mark.parametrize(
    "mask", [dict(ori_mask_mode=0), dict(ori_mask_mode=3), dict(ori_win_left=0, ori_win_right=0),
             dict(ori_win_left=-1, ori_win_right=2), dict(cmp_mask_mode=0, cmp_residual_kv=None)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=lambda c: c.name)
def test_masks(case, mask):
    extra = dict(mask)
    if extra.get("ori_mask_mode", 4) != 4:
        extra.update(ori_win_left=-1, ori_win_right=-1)
    check_forward(case, torch.float32, **extra)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]], ids=lambda c: c.name)
def test_every_kernel_path(case, simd_level):
    check_forward(case, torch.float32)
    check_forward(case, torch.bfloat16)


def test_rows_that_see_nothing():
    # Causal ori keys shorter than the queries, compressed keys not yet whole: the first rows
    # see nothing (zeros; lse the sink, or -inf without one).
    case = Case("early", "BSND", "BSND", 2, 1, 8, (6,), (2,), (1,), cmp_ratio=4,
                residuals=(0,), ori_mask_mode=3)  # fmt: skip
    q, kwargs = make_inputs(case, torch.float32)
    out, lse = opmesh.sparse_flash_mla(q, return_softmax_lse=True, **kwargs)
    assert (out[0, :4] == 0).all() and torch.isneginf(lse[0, 0, :4]).all()
    assert (out[0, 4:] != 0).any()
    sinks = torch.tensor([0.5, -1.0])
    out, lse = opmesh.sparse_flash_mla(q, return_softmax_lse=True, sinks=sinks, **kwargs)
    assert (out[0, :4] == 0).all() and torch.equal(lse[0, 0, 0], sinks)
    check_forward(case, torch.float32)


def test_lse_placeholder_without_return():
    q, kwargs = make_inputs(CASES[0], torch.float32)
    out, lse = opmesh.sparse_flash_mla(q, **kwargs)
    assert lse.shape == () and lse.dtype == torch.float32 and lse.item() == 0


def test_selected_entries_outside_the_mask_are_skipped():
    # A CSA row naming a compressed entry it may not see yet (a future one) leaves it out, as
    # the mask does for HCA: the result equals the selection without it.
    case = CASES[2]
    q, kwargs = make_inputs(case, torch.float32)
    kwargs.pop("cmp_topk_length")
    idx = kwargs["cmp_sparse_indices"]
    idx[:] = -1
    idx[:, :, 0] = 5  # sequence 2's last entry: visible only to its last rows
    idx[:7, :, 0] = 2
    check_forward(case, torch.float32, cmp_sparse_indices=idx, cmp_topk_length=None)


def gradients(case, dtype, *, with_lse=False, seed=3):
    """The op's and the reference's gradients for the same upstream gradients."""
    q, kwargs = make_inputs(case, dtype, seed=seed)
    leaves = {"q": q}
    for name in ("ori_kv", "cmp_kv", "sinks"):
        if kwargs.get(name) is not None:
            leaves[name] = kwargs.pop(name)
    ours = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    ref = {n: t.detach().double().requires_grad_(True) for n, t in leaves.items()}
    out, lse = opmesh.sparse_flash_mla(**ours, return_softmax_lse=with_lse, **kwargs)
    want, wlse = reference(**ref, **kwargs)
    g = torch.Generator().manual_seed(5)
    upstream = torch.randn(want.shape, generator=g, dtype=torch.float64)
    loss = (rows_of(out, case).double() * upstream).sum()
    wloss = (want * upstream).sum()
    if with_lse:
        lse_up = torch.randn(wlse.shape, generator=g, dtype=torch.float64)
        finite = torch.isfinite(wlse)
        loss = loss + (lse_rows(lse, case).double()[finite] * lse_up[finite]).sum()
        wloss = wloss + (wlse[finite] * lse_up[finite]).sum()
    loss.backward()
    wloss.backward()
    return ours, ref


# Backward: float32 sums over the selected keys and tokens; gradients rounded to the dtype.
BACKWARD_TOL = {torch.float32: 2e-4, torch.float64: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
TRAINABLE = [c for c in CASES if c.layout_kv != "PA_BBND"] + [LONG]


def check_gradients(ours, ref, dtype):
    tol = BACKWARD_TOL[dtype]
    for name in ours:
        got, want = ours[name].grad, ref[name].grad
        assert got is not None and got.dtype == ours[name].dtype, name
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", TRAINABLE, ids=lambda c: c.name)
def test_gradients(case, dtype):
    check_gradients(*gradients(case, dtype), dtype)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: c.name)
def test_gradients_through_the_lse(case):
    check_gradients(*gradients(case, torch.float32, with_lse=True), torch.float32)


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=lambda c: c.name)
def test_gradients_on_every_kernel_path(case, simd_level):
    check_gradients(*gradients(case, torch.bfloat16), torch.bfloat16)
    check_gradients(*gradients(case, torch.float32), torch.float32)


def test_gradcheck_float64():
    case = Case("small", "TND", "TND", 2, 1, 8, (5, 3), (5, 3), (2, 1), cmp_ratio=2,
                residuals=(1, 1), win=(2, 0), topk=2, sinks=True)  # fmt: skip
    q, kwargs = make_inputs(case, torch.float64)
    ori, cmp, sinks = kwargs.pop("ori_kv"), kwargs.pop("cmp_kv"), kwargs.pop("sinks").double()

    def f(q, ori, cmp, sinks):
        return opmesh.sparse_flash_mla(
            q, ori_kv=ori, cmp_kv=cmp, sinks=sinks, return_softmax_lse=True, **kwargs
        )

    inputs = tuple(t.requires_grad_(True) for t in (q, ori, cmp, sinks))
    # float64 inputs compute in float32: gradcheck's finite differences need the float64
    # default eps raised to be above float32 rounding.
    assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=2e-3, rtol=2e-3)


THREADS = Case("threads", "BSND", "BSND", 8, 2, 32, (70, 41), (70, 41), (17, 10), cmp_ratio=4,
               residuals=(2, 1), win=(20, 0), topk=8, sinks=True)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [THREADS, LONG], ids=lambda c: c.name)
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


def test_paged_backward_is_refused():
    q, kwargs = make_inputs(CASES[3], torch.float32)
    q.requires_grad_(True)
    out = opmesh.sparse_flash_mla(q, **kwargs)[0]
    assert_raises_named(ValueError, "layout_kv", lambda: out.sum().backward())


def test_empty_inputs():
    # No query heads, no batch, no tokens: empty outputs.
    q = torch.randn(2, 3, 0, 8)
    kv = torch.randn(2, 5, 1, 8)
    out, lse = opmesh.sparse_flash_mla(q, ori_kv=kv, return_softmax_lse=True)
    assert out.shape == q.shape
    q = torch.randn(0, 4, 2, 8, requires_grad=True)
    out, lse = opmesh.sparse_flash_mla(q, ori_kv=torch.randn(0, 4, 1, 8), return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (0, 1, 4, 2)
    out.sum().backward()
    assert q.grad.shape == q.shape
    cu = torch.tensor([0, 0], dtype=torch.int32)
    out, _ = opmesh.sparse_flash_mla(
        torch.randn(0, 2, 8), ori_kv=torch.randn(0, 1, 8), layout_q="TND", layout_kv="TND",
        cu_seqlens_q=cu, cu_seqlens_ori_kv=cu,
    )  # fmt: skip
    assert out.shape == (0, 2, 8)


# Graph mode.


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3], CASES[7]], ids=lambda c: c.name)
def test_opcheck(case):
    q, kwargs = make_inputs(case, torch.float32)
    torch.library.opcheck(OP, (q,), dict(kwargs, return_softmax_lse=True))
    if case.layout_kv == "PA_BBND":
        return
    out, lse = OP(q, return_softmax_lse=True, **kwargs)
    args = (torch.randn_like(out), q, out, lse)
    torch.library.opcheck(BACKWARD, args, dict(kwargs, dlse=torch.randn_like(lse)))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=lambda c: c.name)
def test_compile_fullgraph_forward_and_backward_equal_eager(case, dynamic):
    torch._dynamo.reset()

    def step(q, kwargs):
        out, lse = opmesh.sparse_flash_mla(q, return_softmax_lse=True, **kwargs)
        return out.float().sum() + lse[torch.isfinite(lse)].sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for seed in (0, 1):
        q, kwargs = make_inputs(case, torch.float32, seed=seed)
        if seed == 1 and case.layout_q == "BSND":
            three = dict(q_lens=(9,) * 3, ori_lens=(9,) * 3, cmp_lens=(2,) * 3, residuals=(1,) * 3)
            q, kwargs = make_inputs(Case(**{**case.__dict__, **three}), torch.float32, seed=1)
        leaves = [q] + [kwargs[n] for n in ("ori_kv", "cmp_kv") if n in kwargs]
        for t in leaves:
            t.requires_grad_(True)
        eager = step(q, kwargs)
        grads = torch.autograd.grad(eager, leaves)
        got = compiled(q, kwargs)
        got_grads = torch.autograd.grad(got, leaves)
        torch.testing.assert_close(got, eager)
        for a, b in zip(got_grads, grads, strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tnd_rows_past_a_used_length_are_zero(dtype):
    # TND with seqused_q below a sequence's cu_seqlens_q span: the rows past it are no task's, and
    # are zero (lse: the sink alone) whatever memory the output was given, and so is their dq.
    gen = torch.Generator().manual_seed(5)
    q, kv = torch.randn(9, 4, 32, generator=gen), torch.randn(14, 2, 32, generator=gen)
    q, kv, sinks = q.to(dtype).requires_grad_(), kv.to(dtype).requires_grad_(), torch.randn(4)
    kwargs = dict(cu_seqlens_q=[0, 6, 9], cu_seqlens_ori_kv=[0, 8, 14], seqused_q=[4, 1],
                  sinks=sinks, layout_q="TND", layout_kv="TND", ori_mask_mode=3)  # fmt: skip
    past = [4, 5, 7, 8]
    for _ in range(3):
        torch.full(q.shape, float("nan"), dtype=dtype)  # freed at once: memory an output may get
        out, lse = opmesh.sparse_flash_mla(q, ori_kv=kv, return_softmax_lse=True, **kwargs)
        assert torch.equal(out[past], torch.zeros_like(out[past]))
        lse_rows = lse.permute(1, 0, 2).reshape(9, 4)
        assert torch.equal(lse_rows[past], sinks.expand(len(past), 4))
    ref_kwargs = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    want, want_lse = reference(q.detach().double(), ori_kv=kv.detach().double(), **ref_kwargs)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse_rows.double(), want_lse, atol=tol, rtol=tol)
    (dq,) = torch.autograd.grad(out, q, torch.ones_like(out))
    assert torch.equal(dq[past], torch.zeros_like(dq[past]))


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sink_gradient_counts_the_rows_past_a_used_length(layout):
    # A row past seqused_q holds the sink alone (lse = the sink), so a gradient through the lse
    # reaches the sink from it too.
    gen = torch.Generator().manual_seed(7)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
    kv = torch.randn(2, 8, 2, 32, generator=gen, dtype=torch.float64)
    kwargs = dict(seqused_q=[3, 1], seqused_ori_kv=[8, 5], ori_mask_mode=3)
    q = torch.randn(2, 6, 4, 32, generator=gen, dtype=torch.float64)
    if layout == "TND":
        q, kv = q.flatten(0, 1), kv.flatten(0, 1)
        kwargs = dict(cu_seqlens_q=[0, 6, 12], cu_seqlens_ori_kv=[0, 8, 16], seqused_q=[3, 1],
                      layout_q="TND", layout_kv="TND", ori_mask_mode=3)  # fmt: skip
    out, lse = opmesh.sparse_flash_mla(
        q.float(), ori_kv=kv.float(), sinks=sinks.float(), return_softmax_lse=True, **kwargs
    )
    by_row = (lse.permute(1, 0, 2) if layout == "TND" else lse.permute(0, 2, 1, 3)).reshape(12, 4)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(by_row.shape, generator=gen)
    (got,) = torch.autograd.grad([out, by_row], [sinks], [dout, dlse])
    ref_kwargs = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    want_out, want_lse = reference(q, ori_kv=kv, sinks=sinks, **ref_kwargs)
    (want,) = torch.autograd.grad(
        [want_out, want_lse], [sinks], [dout.reshape(want_out.shape).double(), dlse.double()]
    )
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_export():
    q, kwargs = make_inputs(CASES[2], torch.float32)

    class Layer(torch.nn.Module):
        def forward(self, q, ori_kv, cmp_kv, idx):
            args = {k: v for k, v in kwargs.items() if k not in ("ori_kv", "cmp_kv")}
            args["cmp_sparse_indices"] = idx
            return opmesh.sparse_flash_mla(q, ori_kv=ori_kv, cmp_kv=cmp_kv, **args)[0]

    inputs = (q, kwargs["ori_kv"], kwargs["cmp_kv"], kwargs["cmp_sparse_indices"])
    program = torch.export.export(Layer(), inputs)
    torch.testing.assert_close(program.module()(*inputs), Layer()(*inputs))


# Errors: each names its argument first.


def _call(case=CASES[2], **change):
    q, kwargs = make_inputs(case, torch.float32)
    kwargs.update(change)
    return lambda: opmesh.sparse_flash_mla(q, **kwargs)


def _bad_index(case, value, side="cmp"):
    q, kwargs = make_inputs(case, torch.float32)
    idx = kwargs[f"{side}_sparse_indices"].clone()
    idx.view(-1, idx.shape[-1])[3, 0] = value
    return idx


@pytest.mark.parametrize(
    "name,change",
    [
        ("cmp_sparse_indices", dict(cmp_sparse_indices=_bad_index(CASES[2], 99))),
        ("cmp_sparse_indices", dict(cmp_sparse_indices=_bad_index(CASES[2], -2))),
        ("cmp_topk_length", dict(cmp_topk_length=torch.full((19, 2), 5, dtype=torch.int32))),
        ("cmp_residual_kv", dict(cmp_residual_kv=torch.tensor([2, 0, 0], dtype=torch.int32))),
        ("cmp_residual_kv", dict(cmp_residual_kv=torch.tensor([0, 0], dtype=torch.int32))),
        ("cmp_ratio", dict(cmp_ratio=0)),
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 7, 7, 18], dtype=torch.int32))),
        ("cu_seqlens_ori_kv", dict(cu_seqlens_ori_kv=torch.tensor([1, 7, 7, 19]))),
        ("cu_seqlens_cmp_kv", dict(cu_seqlens_cmp_kv=torch.tensor([0, 3, 2, 9]))),
        ("seqused_ori_kv", dict(seqused_ori_kv=torch.tensor([8, 0, 0]))),
        ("ori_mask_mode", dict(ori_mask_mode=2)),
        ("cmp_mask_mode", dict(cmp_mask_mode=4)),
        ("ori_win_left", dict(ori_win_left=-2)),
        ("ori_win_right", dict(ori_mask_mode=3, ori_win_left=-1, ori_win_right=3)),
        ("topk_value_mode", dict(topk_value_mode=2)),
        ("layout_q", dict(layout_q="BNSD")),
        ("layout_kv", dict(layout_kv="BSND")),
        ("sinks", dict(sinks=torch.zeros(5))),
        ("ori_kv", dict(ori_kv=None, cmp_kv=None, cmp_sparse_indices=None, cmp_topk_length=None,
                        cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, cmp_residual_kv=None)),
        ("ori_kv", dict(ori_kv=torch.randn(19, 2, 16))),
        ("cmp_kv", dict(cmp_kv=torch.randn(9, 3, 20))),
        ("cmp_kv", dict(cmp_kv=torch.randn(9, 2, 20).double())),
        ("cmp_sparse_indices", dict(cmp_sparse_indices=torch.zeros(19, 2, 4))),
        ("ori_topk_length", dict(ori_topk_length=torch.zeros(19, 2, dtype=torch.int32))),
        ("cmp_block_table", dict(cmp_block_table=torch.zeros(3, 2, dtype=torch.int32))),
        ("softmax_scale", dict(softmax_scale=float("nan"))),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_bad_arguments_are_named(name, change):
    assert_raises_named((ValueError, TypeError), name, _call(**change))


@pytest.mark.parametrize(
    "case,name",
    [(2, "cu_seqlens_q"), (2, "cu_seqlens_ori_kv"), (2, "cu_seqlens_cmp_kv"),
     (2, "cmp_residual_kv"), (3, "ori_block_table"), (3, "cmp_block_table"),
     (3, "seqused_ori_kv"), (3, "seqused_cmp_kv")],
)  # fmt: skip
def test_lengths_and_tables_off_the_query_device_are_named(case, name):
    # A meta array would send the call to the shape-only kernel, whose output holds no values.
    q, kwargs = make_inputs(CASES[case], torch.float32)
    bad = {**kwargs, name: kwargs[name].to("meta")}
    assert_raises_named(ValueError, name, lambda: opmesh.sparse_flash_mla(q, **bad))
    if case == 3:
        used = torch.tensor(CASES[case].q_lens, dtype=torch.int32)
        bad = {**kwargs, "seqused_q": used.to("meta")}
        assert_raises_named(ValueError, "seqused_q", lambda: opmesh.sparse_flash_mla(q, **bad))


def test_repeated_index_and_bad_block_table_are_named():
    case = CASES[2]
    q, kwargs = make_inputs(case, torch.float32)
    idx = kwargs["cmp_sparse_indices"].clone()
    idx[8, 0, :2] = torch.tensor([1, 1])
    kwargs["cmp_topk_length"] = None
    kwargs["cmp_sparse_indices"] = idx
    assert_raises_named(
        ValueError, "cmp_sparse_indices", lambda: opmesh.sparse_flash_mla(q, **kwargs)
    )
    q, kwargs = make_inputs(CASES[3], torch.float32)
    table = kwargs["ori_block_table"].clone()
    table[0, 0] = 10_000
    bad = {**kwargs, "ori_block_table": table}
    assert_raises_named(ValueError, "ori_block_table", lambda: opmesh.sparse_flash_mla(q, **bad))
    used = kwargs["seqused_ori_kv"].clone()
    used[0] = 1000
    bad = {**kwargs, "seqused_ori_kv": used}
    assert_raises_named(ValueError, "seqused_ori_kv", lambda: opmesh.sparse_flash_mla(q, **bad))


def test_fuzzed_indices_never_crash():
    # Random values anywhere in the selection: a clear ValueError or a result, never a crash.
    case = CASES[2]
    gen = torch.Generator().manual_seed(11)
    for _ in range(30):
        q, kwargs = make_inputs(case, torch.float32)
        idx = torch.randint(-3, 10, kwargs["cmp_sparse_indices"].shape, generator=gen).int()
        try:
            out, _ = opmesh.sparse_flash_mla(q, **{**kwargs, "cmp_sparse_indices": idx})
        except ValueError as e:
            assert str(e).startswith(("cmp_sparse_indices", "cmp_topk_length")), e
        else:
            assert torch.isfinite(out).all()


# The plan: sparse_flash_mla_metadata.


def plan_for(case: Case, kwargs, q, num_workers=3):
    """sparse_flash_mla_metadata's arguments for the call make_inputs describes."""
    tnd = case.layout_q == "TND"
    args = {n: kwargs.get(n) for n in (
        "cu_seqlens_q", "cu_seqlens_ori_kv", "cu_seqlens_cmp_kv", "seqused_q", "seqused_ori_kv",
        "seqused_cmp_kv", "cmp_residual_kv", "ori_topk_length", "cmp_topk_length")}  # fmt: skip
    for n in ("cmp_ratio", "ori_mask_mode", "cmp_mask_mode", "layout_q", "layout_kv"):
        args[n] = kwargs[n]
    args["ori_win_left"] = kwargs.get("ori_win_left", -1)
    args["ori_win_right"] = kwargs.get("ori_win_right", -1)
    args["batch_size"] = 0 if tnd else q.shape[0]
    args["max_seqlen_q"] = max(case.q_lens) if tnd else q.shape[1]
    for side, lens in (("ori", case.ori_lens), ("cmp", case.cmp_lens)):
        kv = kwargs.get(f"{side}_kv")
        args[f"has_{side}_kv"] = kv is not None
        if kv is not None:
            bsnd = case.layout_kv == "BSND"
            args[f"max_seqlen_{side}_kv"] = kv.shape[1] if bsnd else max(lens)
        idx = kwargs.get(f"{side}_sparse_indices")
        args[f"{side}_topk"] = idx.shape[-1] if idx is not None else 0
    return opmesh.sparse_flash_mla_metadata(
        case.n1, case.n2, case.d, num_workers=num_workers, **args
    )


@pytest.mark.parametrize("workers", [1, 3, 7])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_planned_call_equals_the_unplanned_one(case, workers):
    q, kwargs = make_inputs(case, torch.float32)
    metadata = plan_for(case, kwargs, q, workers)
    assert metadata.dtype == torch.int32 and metadata.shape == (53 + 5 * workers,)
    planned = opmesh.sparse_flash_mla(q, metadata=metadata, return_softmax_lse=True, **kwargs)
    free = opmesh.sparse_flash_mla(q, return_softmax_lse=True, **kwargs)
    # A unit split between workers merges its pieces by their log-sum-exp: float32 rounding.
    torch.testing.assert_close(planned[0], free[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(planned[1], free[1], rtol=1e-5, atol=1e-6)
    again = opmesh.sparse_flash_mla(q, metadata=metadata, return_softmax_lse=True, **kwargs)
    assert torch.equal(again[0], planned[0]) and torch.equal(again[1], planned[1])
    plan = opmesh.describe_metadata(metadata)
    assert plan["num_workers"] == workers and plan["rows"] == sum(case.q_lens)
    stretches = plan["workers"]
    assert stretches[0][0] == (0, 0) and stretches[-1][1] == (plan["rows"] * case.n2, 0)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(stretches))


@pytest.mark.parametrize("workers", [2, 16, 128])
@pytest.mark.parametrize(
    "shape", [(8192, 1), (1024, 8), (1, 64)], ids=["long", "batch", "decode"]
)  # S and B: one long prefill, a batch of uneven prefills, a decode batch
def test_makespan_within_five_percent_of_the_lower_bound(shape, workers):
    s, b = shape
    gen = torch.Generator().manual_seed(0)
    lens = (
        [s] * b if s * b in (s, b) else torch.randint(s // 4, s + 1, (b,), generator=gen).tolist()
    )
    ori = [n + 500 for n in lens] if s == 1 else lens
    cu = _cumulative(lens)
    metadata = opmesh.sparse_flash_mla_metadata(
        64, 1, 512, cu_seqlens_q=cu, cu_seqlens_ori_kv=_cumulative(ori),
        cu_seqlens_cmp_kv=_cumulative([n // 4 for n in ori]),
        cmp_residual_kv=[n % 4 for n in ori], max_seqlen_q=max(lens), max_seqlen_ori_kv=max(ori),
        max_seqlen_cmp_kv=max(ori) // 4, cmp_topk=512, cmp_ratio=4, ori_mask_mode=4,
        cmp_mask_mode=3, ori_win_left=127, ori_win_right=0, layout_q="TND", layout_kv="TND",
        num_workers=workers,
    )  # fmt: skip
    plan = opmesh.describe_metadata(metadata)
    assert plan["makespan"] <= 1.05 * plan["lower_bound"], plan["makespan"] / plan["lower_bound"]


MISMATCHES = [
    dict(ori_win_left=3),
    dict(cmp_ratio=3, cmp_residual_kv=torch.tensor([1, 0, 0], dtype=torch.int32)),
    dict(cmp_residual_kv=torch.tensor([0, 0, 0], dtype=torch.int32)),
    dict(seqused_q=torch.tensor([7, 0, 11], dtype=torch.int32)),
    dict(cmp_topk_length=None),
    dict(cmp_sparse_indices=torch.full((19, 2, 5), -1, dtype=torch.int32), cmp_topk_length=None),
    dict(sinks=None, q=torch.randn(19, 4, 20)),
]


@pytest.mark.parametrize("change", MISMATCHES, ids=lambda c: ",".join(c))
def test_a_plan_made_for_another_call_is_refused(change):
    case = CASES[2]
    q, kwargs = make_inputs(case, torch.float32)
    metadata = plan_for(case, kwargs, q)
    change = dict(change)
    q = change.pop("q", q)
    call = {**kwargs, **change}
    assert_raises_named(
        ValueError, "metadata", lambda: opmesh.sparse_flash_mla(q, metadata=metadata, **call)
    )


def test_plan_arguments_are_checked_by_name():
    plan = opmesh.sparse_flash_mla_metadata
    assert_raises_named(ValueError, "max_seqlen_q", lambda: plan(
        4, 1, 8, cu_seqlens_q=[0, 3, 9], cu_seqlens_ori_kv=[0, 3, 9], max_seqlen_q=5,
        max_seqlen_ori_kv=6, layout_q="TND", layout_kv="TND", has_cmp_kv=False))  # fmt: skip
    assert_raises_named(ValueError, "num_workers", lambda: plan(4, 1, 8, batch_size=1,
        max_seqlen_q=3, max_seqlen_ori_kv=3, has_cmp_kv=False, num_workers=0))  # fmt: skip
    assert_raises_named(ValueError, "cmp_topk_length", lambda: plan(4, 1, 8, batch_size=1,
        max_seqlen_q=3, max_seqlen_ori_kv=3, max_seqlen_cmp_kv=1, cmp_topk=2,
        cmp_topk_length=torch.tensor([[1], [3], [0]]), cmp_mask_mode=3))  # fmt: skip
    assert_raises_named(ValueError, "ori_kv", lambda: plan(4, 1, 8, batch_size=1,
        max_seqlen_q=3, has_ori_kv=False, has_cmp_kv=False))  # fmt: skip
    # A meta length array: the plan needs its values (its shape alone gave uninitialized words).
    meta = torch.tensor([3], dtype=torch.int32).to("meta")
    assert_raises_named(ValueError, "seqused_ori_kv", lambda: plan(4, 1, 8, batch_size=1,
        max_seqlen_q=3, max_seqlen_ori_kv=3, has_cmp_kv=False, seqused_ori_kv=meta))  # fmt: skip
    md = plan(4, 1, 8, batch_size=1, max_seqlen_q=3, max_seqlen_ori_kv=3, has_cmp_kv=False)
    bad = md.clone()
    bad[0] = 7
    q, kv = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 1, 8)
    assert_raises_named(ValueError, "metadata", lambda: opmesh.sparse_flash_mla(
        q, ori_kv=kv, ori_mask_mode=0, cmp_mask_mode=0, metadata=bad))  # fmt: skip
    out = opmesh.sparse_flash_mla(q, ori_kv=kv, ori_mask_mode=0, cmp_mask_mode=0, metadata=md)
    torch.testing.assert_close(
        out[0], opmesh.sparse_flash_mla(q, ori_kv=kv, ori_mask_mode=0, cmp_mask_mode=0)[0]
    )


def test_plan_under_compile():
    case = CASES[2]
    q, kwargs = make_inputs(case, torch.float32)

    def step(q, kwargs):
        md = plan_for(case, kwargs, q, num_workers=2)
        return opmesh.sparse_flash_mla(q, metadata=md, **kwargs)[0]

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, kwargs)
    torch.testing.assert_close(got, step(q, kwargs), rtol=0, atol=0)
