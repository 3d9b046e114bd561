"""flash_attn and its planner against the PyTorch alternatives, in one run.

1. Dense causal attention (B in {1, 4}, S = 4096, 32 query / 8 key heads, D = 128) against
   scaled_dot_product_attention's CPU flash kernel (with enable_gqa, and with the key/value heads
   repeated, whichever is faster), and against torch.mm's GFLOP/s on this machine.
2. Variable-length causal attention: 32 sequences, lognormal lengths (mean ~1k, capped at 16k,
   fixed seed), against SDPA per sequence in a loop and padded SDPA (boolean padding + causal
   mask, and right padding with is_causal, which needs no mask).
3. Plan quality for the same batch: makespan / lower bound of our plan and of three published
   policies re-implemented here over the same units and cost model.
4. flash_attn_metadata latency for a batch of 1024 sequences.
5. Measured balance on the real kernel: per-worker busy time of the varlen batch.

GFLOP/s count 4 * D * (visible query-key pairs) per head for every method, so ratios are time
ratios.

    python benchmarks/bench_flash_attn.py [--quick]
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    best_on_this_tier,
    interleaved,
    tier_compositions,
    tier_matmul_dtype,
    time_call,
    write_results,
)

import opmesh  # noqa: E402
from opmesh import _C  # noqa: E402
from opmesh._plan_view import plan_pieces, varlen_metadata  # noqa: E402

NQ, NKV, D = 32, 8, 128
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def causal_flops(lengths, heads=NQ, dim=D):
    return sum(4 * heads * dim * n * (n + 1) // 2 for n in lengths)


def sdpa_dense(q, k, v, repeat):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if repeat:
        group = qt.shape[1] // kt.shape[1]
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)


def dense_section(args):
    rows = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        # The tier's matmul rate: float32 where it has no bf16 products, else the dtype's.
        mm_dtype = tier_matmul_dtype(dtype)
        a, b = (torch.randn(4096, 4096).to(mm_dtype) for _ in range(2))
        for batch in args.batches:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(batch, args.seq, NQ, D, generator=g).to(dtype)
            k = torch.randn(batch, args.seq, NKV, D, generator=g).to(dtype)
            v = torch.randn(batch, args.seq, NKV, D, generator=g).to(dtype)
            flops = causal_flops([args.seq] * batch)
            methods = {
                "opmesh": partial(opmesh.flash_attn, q, k, v, mask_mode=3),
                **tier_compositions("sdpa (enable_gqa)", sdpa_dense, q, k, v, False),
                **tier_compositions("sdpa (repeated kv)", sdpa_dense, q, k, v, True),
            }
            # The methods and the mm they are compared with are timed in turn over three rounds,
            # so that the machine's drift stays out of the ratios.
            medians = interleaved(
                [*methods.values(), partial(torch.mm, a, b)], budget_s=args.budget, min_repeats=1
            )
            times = dict(zip(methods, medians, strict=False))
            mm = 2 * 4096**3 / medians[-1] / 1e9
            best_sdpa = times[best_on_this_tier(times, ["opmesh"])]
            for method, t in times.items():
                gflops = flops / t / 1e9
                rows.append(
                    {
                        "dtype": name,
                        "B": batch,
                        "method": method,
                        "ms": f"{t * 1e3:.1f}",
                        "GFLOP/s": f"{gflops:.1f}",
                        "vs best SDPA": f"{best_sdpa / t:.2f}x",
                        "% of mm": f"{100 * gflops / mm:.0f}%",
                        "mm GFLOP/s": f"{mm:.0f}",
                    }
                )
            print(rows[-3:], flush=True)
    return rows


def varlen_lengths(seed=0, count=32, mean=1000, cap=16384):
    """Heavy-tailed lengths: lognormal (sigma 1), rescaled so the batch mean is `mean`, capped."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(0.0, 1.0, count)
    x *= mean / x.mean()
    return [int(min(cap, max(1, round(v)))) for v in x]


def varlen_inputs(lengths, dtype):
    g = torch.Generator().manual_seed(1)
    total = sum(lengths)
    q = torch.randn(total, NQ, D, generator=g).to(dtype)
    k = torch.randn(total, NKV, D, generator=g).to(dtype)
    v = torch.randn(total, NKV, D, generator=g).to(dtype)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    return q, k, v, cu


def plan(lengths, num_workers):
    """flash_attn_metadata for the causal TND batch of `lengths` (benchmark heads and dims)."""
    return varlen_metadata(
        lengths,
        lengths,
        heads_q=NQ,
        heads_kv=NKV,
        head_dim=D,
        mask_mode=3,
        num_workers=num_workers,
    )


def ours_varlen(q, k, v, cu, lengths, md):
    return opmesh.flash_attn(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        metadata=md,
        mask_mode=3,
        layout_q="TND",
        layout_kv="TND",
        layout_out="TND",
    )


def sdpa_loop(q, k, v, cu, lengths):
    outs = []
    for b, n in enumerate(lengths):
        s = slice(int(cu[b]), int(cu[b]) + n)
        # 4-D [1, N, S, D] inputs: with 3-D ones SDPA leaves its CPU flash kernel (4x slower).
        qs, ks, vs = (x[s].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def pad(x, cu, lengths):
    out = x.new_zeros(len(lengths), max(lengths), *x.shape[1:])
    for b, n in enumerate(lengths):
        out[b, :n] = x[int(cu[b]) : int(cu[b]) + n]
    return out.transpose(1, 2)  # [B, N, S, D]


def sdpa_padded(q, k, v, cu, lengths, masked):
    qp, kp, vp = pad(q, cu, lengths), pad(k, cu, lengths), pad(v, cu, lengths)
    if masked:
        s = max(lengths)
        valid = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]  # [B, S]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        mask = (causal[None] & valid[:, None, :] & valid[:, :, None]) | ~valid[:, :, None]
        return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask[:, None], enable_gqa=True)
    return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)


def time_once(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def varlen_section(args, lengths):
    rows = []
    flops = causal_flops(lengths)
    for name in args.dtypes:
        dtype = DTYPES[name]
        q, k, v, cu = varlen_inputs(lengths, dtype)
        md = plan(
            lengths,
            torch.get_num_threads(),
        )
        times = {
            "opmesh (planned)": time_call(
                partial(ours_varlen, q, k, v, cu, lengths, md), budget_s=args.budget
            ),
            "opmesh (metadata=None)": time_call(
                partial(ours_varlen, q, k, v, cu, lengths, None), budget_s=args.budget
            ),
        }
        # The SDPA compositions as a user of the tier runs them (on float32 tiers, on the bf16
        # inputs made float32 too); the padded ones are slow, timed once or twice.
        for label, fn in tier_compositions("sdpa loop", sdpa_loop, q, k, v, cu, lengths).items():
            times[label] = time_call(fn, budget_s=args.budget)
        padded = tier_compositions(
            "sdpa padded, is_causal", sdpa_padded, q, k, v, cu, lengths, False
        )
        for label, fn in padded.items():
            times[label] = time_call(fn, min_repeats=1, budget_s=0)
        if not args.quick:
            masked = tier_compositions("sdpa padded, mask", sdpa_padded, q, k, v, cu, lengths, True)
            for label, fn in masked.items():
                times[label] = time_once(fn)
        ours = times["opmesh (planned)"]
        best_sdpa = times[best_on_this_tier(times, ["opmesh (planned)", "opmesh (metadata=None)"])]
        for method, t in times.items():
            rows.append(
                {
                    "dtype": name,
                    "method": method,
                    "ms": f"{t * 1e3:.1f}",
                    "GFLOP/s": f"{flops / t / 1e9:.1f}",
                    "ours is": f"{t / ours:.2f}x faster",
                    "vs best SDPA": f"{best_sdpa / t:.2f}x",
                }
            )
        print(rows[-len(times) :], flush=True)
    return rows


# --- plan quality ----------------------------------------------------------------------------


def units_of(lengths):
    """Every (sequence, key head, query tile) unit with its modelled cost, from a one-worker plan
    (whose single stretch lists every unit whole)."""
    md = plan(lengths, 1)
    positions = opmesh.describe_metadata(md)["query_positions_per_tile"]
    units = []
    for p in plan_pieces(md, lengths, lengths)[0]:
        q_rows = min(positions, lengths[p["b"]] - p["t"] * positions)
        kv = min(lengths[p["b"]], (p["t"] * positions + q_rows))  # causal: keys seen by last row
        tiles = p["k_to"] - p["k_from"]
        units.append(
            {
                "cost": p["cost"],
                "task": p["task_cost"],
                "combine": p["combine_cost"],
                "tiles": tiles,
                "q": q_rows,
                "kv": kv,
            }
        )
    return units


def fa2_grid(units, workers):
    """One task per unit, handed out in launch order to whichever worker is free first."""
    heap = [(0.0, w) for w in range(workers)]
    for u in units:
        load, w = heapq.heappop(heap)
        heapq.heappush(heap, (load + u["cost"], w))
    return max(load for load, _ in heap)


def flashmla_greedy(units, workers):
    """Contiguous greedy: each worker takes units in order up to total / workers plus a fixed
    overhead, splitting a unit along its key tiles where the budget ends; every continued piece
    pays the fixed task cost again and a combine."""
    total = sum(u["cost"] for u in units)
    overhead = max(u["task"] + u["combine"] for u in units)
    payload = total / workers + overhead
    loads, load, w = [], 0.0, 0
    for u in units:
        remaining = u["cost"]
        per_tile = (u["cost"] - u["task"]) / max(u["tiles"], 1)
        while remaining > 1e-9:
            room = payload - load
            if remaining <= room or w == workers - 1:
                load += remaining
                remaining = 0.0
            else:
                fit = int((room - (u["task"] if remaining < u["cost"] else 0)) // per_tile)
                if fit >= 1 and u["tiles"] > 1:
                    load += fit * per_tile + (u["task"] if remaining == u["cost"] else 0)
                    remaining -= fit * per_tile + (u["task"] if remaining == u["cost"] else 0)
                    remaining += u["task"] + u["combine"]  # the continued piece's overhead
                loads.append(load)
                load, w = 0.0, w + 1
    loads.append(load)
    return max(loads)


def flashinfer_lpt(units, workers):
    """Longest first by the estimate 2 * q + kv onto the least loaded worker (by estimate);
    the makespan is then evaluated with the real modelled costs."""
    order = sorted(units, key=lambda u: 2 * u["q"] + u["kv"], reverse=True)
    heap = [(0.0, w) for w in range(workers)]
    actual = [0.0] * workers
    for u in order:
        est, w = heapq.heappop(heap)
        actual[w] += u["cost"]
        heapq.heappush(heap, (est + 2 * u["q"] + u["kv"], w))
    return max(actual)


def plan_section(lengths, worker_counts):
    units = units_of(lengths)
    rows = []
    for workers in worker_counts:
        md = plan(lengths, workers)
        s = opmesh.describe_metadata(md)
        lb = s["lower_bound"]
        results = {
            "opmesh": s["makespan"],
            "FA2 grid (one task per tile)": fa2_grid(units, workers),
            "FlashMLA (contiguous greedy)": flashmla_greedy(units, workers),
            "FlashInfer (LPT on 2q+kv)": flashinfer_lpt(units, workers),
        }
        best = min(results.values())
        for method, makespan in results.items():
            rows.append(
                {
                    "workers": workers,
                    "policy": method,
                    "makespan / lower bound": f"{makespan / lb:.6f}",
                    "best": "yes" if makespan <= best * (1 + 1e-9) else "",
                    "splits": s["num_splits"] if method == "opmesh" else "",
                }
            )
        print(rows[-4:], flush=True)
    return rows


# --- metadata latency --------------------------------------------------------------------------


def latency_section(worker_counts):
    rng = np.random.default_rng(2)
    batch = 1024
    decode_kv = rng.integers(1, 4096, batch).tolist()
    prefill = varlen_lengths(seed=3, count=batch, mean=256, cap=4096)
    cases = {
        "decode (q=1, kv<4096)": ([1] * batch, decode_kv),
        "prefill (lognormal, mean 256)": (prefill, prefill),
    }
    rows = []
    for name, (ql, kl) in cases.items():
        cu_q = torch.tensor([0, *np.cumsum(ql).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *np.cumsum(kl).tolist()], dtype=torch.int32)
        for workers in worker_counts:
            call = partial(
                torch.ops.opmesh.flash_attn_metadata,
                NQ,
                NKV,
                D,
                cu_seqlens_q=cu_q,
                cu_seqlens_kv=cu_k,
                batch_size=batch,
                max_seqlen_q=max(ql),
                max_seqlen_kv=max(kl),
                mask_mode=3,
                layout_q="TND",
                layout_kv="TND",
                layout_out="TND",
                num_workers=workers,
            )
            for _ in range(20):
                call()
            samples = []
            for _ in range(200):
                t0 = time.perf_counter()
                call()
                samples.append(time.perf_counter() - t0)
            s = opmesh.describe_metadata(call())
            rows.append(
                {
                    "batch": name,
                    "workers": workers,
                    "median us": f"{statistics.median(samples) * 1e6:.1f}",
                    "p90 us": f"{np.percentile(samples, 90) * 1e6:.1f}",
                    "tasks": s["num_tasks"],
                    "makespan / lower bound": f"{s['makespan'] / s['lower_bound']:.4f}",
                }
            )
        print(rows[-len(worker_counts) :], flush=True)
    return rows


def imbalance_section(lengths, worker_counts):
    q, k, v, cu = varlen_inputs(lengths, torch.bfloat16)
    rows = []
    _C._set_worker_timing(True)
    try:
        for workers in worker_counts:
            md = plan(lengths, workers)
            ours_varlen(q, k, v, cu, lengths, md)
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                ours_varlen(q, k, v, cu, lengths, md)
                runs.append((time.perf_counter() - t0, _C._last_worker_times()))
            wall, busy = min(runs)
            predicted = opmesh.describe_metadata(md)["worker_cost"]
            rows.append(
                {
                    "logical workers": workers,
                    "threads": torch.get_num_threads(),
                    "busy max / mean (measured)": f"{max(busy) / statistics.mean(busy):.3f}",
                    "cost max / mean (model)": f"{max(predicted) / statistics.mean(predicted):.3f}",
                    "busy min..max ms": f"{min(busy) / 1e6:.1f}..{max(busy) / 1e6:.1f}",
                    "wall ms": f"{wall * 1e3:.1f}",
                }
            )
            print(rows[-1], flush=True)
    finally:
        _C._set_worker_timing(False)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per method")
    parser.add_argument("--quick", action="store_true", help="skip the slowest baselines")
    parser.add_argument(
        "--sections", nargs="+", default=["dense", "varlen", "plan", "latency", "imbalance"]
    )
    args = parser.parse_args()
    lengths = varlen_lengths()
    command = "`.venv/bin/python benchmarks/bench_flash_attn.py`"
    lens_note = (
        f"Varlen batch: {len(lengths)} sequences, lengths {sorted(lengths)} "
        f"(mean {statistics.mean(lengths):.0f}, max {max(lengths)})."
    )
    if "dense" in args.sections:
        rows = dense_section(args)
        write_results(
            "flash_attn_dense",
            rows,
            list(rows[0]),
            notes=[f"Causal, S = {args.seq}, {NQ} query / {NKV} key heads, D = {D}.", "", command],
            tier_baselines=True,
        )
    if "varlen" in args.sections:
        rows = varlen_section(args, lengths)
        write_results(
            "flash_attn_varlen",
            rows,
            list(rows[0]),
            notes=["Causal, TND, 32 query / 8 key heads, D = 128.", lens_note, "", command],
            tier_baselines=True,
        )
    if "plan" in args.sections:
        rows = plan_section(lengths, [2, 24, 132])
        write_results(
            "flash_attn_plan_quality",
            rows,
            list(rows[0]),
            notes=[
                "All four policies place the same (sequence, key head, query tile) units under the "
                "same cost model; the lower bound is max(total / workers, largest indivisible "
                "piece).",
                lens_note,
                "",
                command,
            ],
        )
    if "latency" in args.sections:
        rows = latency_section([torch.get_num_threads(), 132])
        write_results(
            "flash_attn_metadata_latency",
            rows,
            list(rows[0]),
            notes=[
                "Wall time of one torch.ops.opmesh.flash_attn_metadata call from Python, lengths "
                "already in int32 tensors.",
                "",
                command,
            ],
        )
    if "imbalance" in args.sections:
        rows = imbalance_section(lengths, [torch.get_num_threads(), 24, 132])
        write_results(
            "flash_attn_imbalance",
            rows,
            list(rows[0]),
            notes=[
                "Busy time of each logical worker of the varlen batch (bf16), measured inside the "
                "kernel; logical workers beyond the thread count run one after another on the "
                "threads.",
                lens_note,
                "",
                command,
            ],
        )


if __name__ == "__main__":
    main()
