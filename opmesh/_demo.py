"""``python -m opmesh demo``: the operators on realistic inputs, eager and compiled, checked
against float64 evaluations of their formulas on a sample of rows; the varlen attention part
also shows how its batch is planned."""

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

    _flash_attn_demo(g)


def _attention_rows(q, k, v, rows):
    """Float64 causal attention of one sequence ([S, N, D] tensors, GQA) for the given rows,
    written from the definition."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q[rows].double(), k.double(), v.double()
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("ind,jnd->nij", q, k) / q.shape[-1] ** 0.5
    visible = torch.arange(k.shape[0])[None, :] <= rows[:, None]  # one sequence: s1 == s2
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("nij,jne->ine", torch.softmax(scores, -1), v)


def _flash_attn_demo(g, heads_q=32, heads_kv=8, dim=128):
    lengths = [3000, 17, 512, 0, 1800, 64, 2500, 900]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = sum(lengths)
    q = torch.randn(total, heads_q, dim, generator=g, dtype=torch.bfloat16)
    k = torch.randn(total, heads_kv, dim, generator=g, dtype=torch.bfloat16)
    v = torch.randn(total, heads_kv, dim, generator=g, dtype=torch.bfloat16)
    tnd = dict(layout_q="TND", layout_kv="TND", layout_out="TND", mask_mode=3)
    print(
        f"\nflash_attn, TND causal varlen: {len(lengths)} sequences {lengths}, "
        f"{heads_q} query / {heads_kv} key heads, D={dim}, {q.dtype}"
    )

    def plan(workers=None):
        return opmesh.flash_attn_metadata(
            heads_q,
            heads_kv,
            dim,
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            batch_size=len(lengths),
            max_seqlen_q=max(lengths),
            max_seqlen_kv=max(lengths),
            num_workers=workers,
            **tnd,
        )

    for workers in (torch.get_num_threads(), 24):
        s = opmesh.describe_metadata(plan(workers))
        print(
            f"  plan for {workers:3d} workers: {s['num_tasks']} tasks, {s['num_splits']} split "
            f"query tiles, makespan / lower bound = {s['makespan'] / s['lower_bound']:.4f}"
        )
    md = plan()

    def attend(q, k, v, md):
        return opmesh.flash_attn(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, metadata=md, **tnd)

    (out, _), eager_s = _timed(lambda: attend(q, k, v, md))
    compiled = torch.compile(attend, fullgraph=True)
    compiled(q, k, v, md)
    (cout, _), compiled_s = _timed(lambda: compiled(q, k, v, md))
    flops = sum(4 * heads_q * dim * n * (n + 1) // 2 for n in lengths)
    print(f"  eager:    {eager_s * 1e3:8.1f} ms  ({flops / eager_s / 1e9:.0f} GFLOP/s)")
    print(f"  compiled: {compiled_s * 1e3:8.1f} ms; identical to eager: {torch.equal(cout, out)}")
    start, n = int(cu[6]), lengths[6]
    rows = torch.unique(torch.linspace(0, n - 1, 32).long())
    want = _attention_rows(q[start : start + n], k[start : start + n], v[start : start + n], rows)
    err = (out[start + rows].double() - want).abs().max().item()
    print(
        f"  vs float64 formula on {len(rows)} rows of the 2500-token sequence: max |err| {err:.2e}"
    )
