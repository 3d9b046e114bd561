"""``python -m opmesh demo``: the indexer operator on a realistic input, eager and compiled, checked
against a float64 evaluation of its formula on a sample of rows."""

from __future__ import annotations

import time

import torch

import opmesh


def _timed(fn, repeats=3):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    return out, (time.perf_counter() - start) / repeats


def _formula_rows(q, k, w, rows):
    """Float64 max/sum of I[i, j] = sum_h w[i,h] relu(q[i,h].k[j]) for the given query rows of a
    causal BSND batch of one sequence with one key head (a check, written from the definition)."""
    q, k, w = q[0, rows].double(), k[0, :, 0].double(), w[0, rows].double()
    scores = torch.einsum("ih,ihj->ij", w, torch.einsum("ihd,jd->ihj", q, k).clamp_min(0))
    visible = torch.arange(k.shape[0])[None, :] <= rows[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    m = scores.amax(-1)
    return m, torch.exp(scores - m[:, None]).sum(-1)


def run_demo(seq=4096, heads=64, dim=128):
    print(
        f"opmesh demo: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"SIMD {opmesh.active_simd_level()} (available: {', '.join(opmesh.simd_levels())})"
    )
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, heads, dim, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, seq, 1, dim, generator=g, dtype=torch.bfloat16)
    w = torch.randn(1, seq, heads, generator=g) * (heads * dim) ** -0.5
    print(
        f"\ndense_lightning_indexer_softmax_lse, BSND causal: query_index {tuple(q.shape)} "
        f"{q.dtype}, key_index {tuple(k.shape)}, weights {tuple(w.shape)} {w.dtype}"
    )

    op = opmesh.dense_lightning_indexer_softmax_lse
    (m, s), eager_s = _timed(lambda: op(q, k, w))
    compiled = torch.compile(lambda a, b, c: op(a, b, c), fullgraph=True, dynamic=True)
    start = time.perf_counter()
    compiled(q, k, w)
    compile_s = time.perf_counter() - start
    (cm, cs), compiled_s = _timed(lambda: compiled(q, k, w))
    flops = seq * (seq + 1) / 2 * 2 * heads * dim
    print(f"  outputs: softmax_max {tuple(m.shape)} {m.dtype}, softmax_sum {tuple(s.shape)}")
    print(f"  eager:    {eager_s * 1e3:8.1f} ms  ({flops / eager_s / 1e9:.0f} GFLOP/s)")
    print(
        f"  compiled: {compiled_s * 1e3:8.1f} ms  (first call incl. compilation "
        f"{compile_s:.1f} s); identical to eager: {torch.equal(cm, m) and torch.equal(cs, s)}"
    )

    rows = torch.unique(torch.linspace(0, seq - 1, 64).long())
    want_m, want_s = _formula_rows(q, k, w, rows)
    err_m = (m[0, 0, rows].double() - want_m).abs().max().item()
    err_s = ((s[0, 0, rows].double() - want_s).abs() / want_s).max().item()
    print(
        f"  vs float64 formula on {len(rows)} rows: max |err| of softmax_max {err_m:.2e}, "
        f"max rel err of softmax_sum {err_s:.2e}"
    )

    lengths = [700, 0, 1500, 33]
    tq = torch.randn(sum(lengths), heads, dim, generator=g, dtype=torch.bfloat16)
    tk = torch.randn(sum(lengths), 1, dim, generator=g, dtype=torch.bfloat16)
    tw = torch.randn(sum(lengths), heads, generator=g) * (heads * dim) ** -0.5
    ends = torch.tensor(lengths).cumsum(0)
    (vm, vs), varlen_s = _timed(
        lambda: op(tq, tk, tw, actual_seq_qlen=ends, actual_seq_klen=ends, layout="TND")
    )
    print(
        f"\nTND varlen batch, sequence lengths {lengths} (one empty): softmax_max "
        f"{tuple(vm.shape)}, {varlen_s * 1e3:.1f} ms, all finite: {bool(torch.isfinite(vm).all())}"
    )
