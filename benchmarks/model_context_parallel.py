"""A model (not a measurement) of context-parallel causal attention at 8-64 ranks: the
communication each rank sends, the balance of the work, and the expected efficiency of the
all-gather, ring, Ulysses (all-to-all) and hybrid (Ulysses x ring) strategies.

Inputs (command-line options, defaults in brackets): sequence S [131072], query heads Nq [32],
key/value heads Nkv [8], head dim D [128], bytes per element [2, bf16], attention throughput per
rank F [80 GFLOP/s, about what one core of the benchmark machine gives opmesh's bf16 forward;
see bench_context_parallel.py], link bandwidth per rank B [12.5 GB/s], latency per message
alpha [20 us].

Formulas, for n ranks (forward; the backward has the same shape with 2.5x the work and the
dk/dv partials travelling too):

* work W = 4 Nq D S (S + 1) / 2 flops (causal); a block of (S/n) rows by (S/n) keys costs
  W_b = 4 Nq D (S/n)^2.
* balance (max / mean work per rank): contiguous shards give rank r the rows
  [r S/n, (r+1) S/n), work proportional to 2r + 1, so max/mean = (2n - 1) / n; head-tail order
  gives rank r chunks r and 2n - 1 - r, whose work sums to the same for every rank: 1.
* bytes sent per rank, both strategies: each rank's key and value shard goes to the n - 1 others
  (all-gather) or is passed on n - 1 times (ring): V = (n - 1) (S/n) Nkv D 2 bytes.
* all-gather time: T_ag = alpha (n - 1) + V / B + W_max / F, with W_max = W (2n - 1) / n^2
  (contiguous) or W / n (head-tail); the gather is not overlapped.
* ring time (contiguous, lockstep): the diagonal block first, then n - 1 steps, each as long as
  the longer of a full block and one transfer: T_ring = W_b / (2F) + (n - 1) max(W_b / F,
  alpha + C / B), C = (S/n) Nkv D 2 bytes. (Every step has a rank with a full block: rank n - 1.)
* Ulysses: q, k, v and the output are exchanged all-to-all between sequence and head shards;
  each rank then attends ceil(Nq / n) heads over the whole sequence (balanced, but idle ranks
  once n > Nq), the key heads repeated r times (the smallest r for which the heads split n ways
  keep their groups). Bytes sent: V_u = (n - 1) / n (S/n) D bytes (2 Nq + 2 Nkv r);
  T_u = 4 alpha (n - 1) + V_u / B + W ceil(Nq / n) / (Nq F), not overlapped.
* hybrid: Ulysses over u = min(n, Nkv) ranks (no key head repeated), then the ring over the
  r = n / u ranks of the other axis with Nq/u query and Nkv/u key heads per rank:
  T_h = 4 alpha (u - 1) + V_1 / B + T_ring(r ranks, Nq/u heads), V_1 the Ulysses bytes of the
  u-way exchange on S/n rows, plus the ring's (r - 1) chunks of (S/r) (Nkv/u) D 2 bytes.
* efficiency E = (W / F) / (n T).

Run: ``.venv/bin/python benchmarks/model_context_parallel.py``; writes
benchmarks/results/context_parallel_model.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402


def model(n, seq, heads, kv_heads, dim, elem_bytes, flops_per_s, bandwidth, alpha):
    work = 4 * heads * dim * seq * (seq + 1) / 2
    rows = seq / n
    block = 4 * heads * dim * rows * rows
    chunk_bytes = rows * kv_heads * dim * 2 * elem_bytes
    sent = (n - 1) * chunk_bytes
    contiguous_max = work * (2 * n - 1) / n**2
    balanced_max = work / n
    gather = alpha * (n - 1) + sent / bandwidth
    t_ag = gather + contiguous_max / flops_per_s
    t_ag_ht = gather + balanced_max / flops_per_s
    transfer = alpha + chunk_bytes / bandwidth
    step = max(block / flops_per_s, transfer)
    t_ring = block / (2 * flops_per_s) + (n - 1) * step
    ideal = work / flops_per_s
    # Ulysses: the head split of n ranks, key heads repeated as far as the split needs.
    per_rank_heads = -(-heads // n)
    group = heads // kv_heads
    repeat = next(
        r
        for r in range(1, group + 1)
        if group % r == 0 and per_rank_heads == (group // r) * -(-(kv_heads * r) // n)
    )
    u_bytes = (n - 1) / n * rows * dim * elem_bytes * (2 * heads + 2 * kv_heads * repeat)
    t_u = 4 * alpha * (n - 1) + u_bytes / bandwidth + work * per_rank_heads / heads / flops_per_s
    # Hybrid: Ulysses over u ranks, the ring over r = n / u.
    u = min(n, kv_heads)
    r = n // u
    h_bytes1 = (u - 1) / u * rows * dim * elem_bytes * (2 * heads + 2 * kv_heads)
    r_rows = seq / r
    r_block = 4 * (heads / u) * dim * r_rows * r_rows
    r_chunk = r_rows * (kv_heads / u) * dim * 2 * elem_bytes
    r_step = max(r_block / flops_per_s, alpha + r_chunk / bandwidth)
    t_h = (
        4 * alpha * (u - 1) + h_bytes1 / bandwidth + r_block / (2 * flops_per_s) + (r - 1) * r_step
    )
    h_bytes = h_bytes1 + (r - 1) * r_chunk
    return {
        "ranks": n,
        "MiB sent per rank": f"{sent / 2**20:.1f}",
        "balance contiguous": f"{(2 * n - 1) / n:.2f}",
        "balance head-tail": "1.00",
        "all-gather ms": f"{t_ag * 1e3:.0f}",
        "all-gather E": f"{ideal / (n * t_ag):.0%}",
        "all-gather+head-tail ms": f"{t_ag_ht * 1e3:.0f}",
        "all-gather+head-tail E": f"{ideal / (n * t_ag_ht):.0%}",
        "ring ms": f"{t_ring * 1e3:.0f}",
        "ring E": f"{ideal / (n * t_ring):.0%}",
        "ring step compute/transfer": f"{(block / flops_per_s) / transfer:.1f}",
        "ulysses MiB": f"{u_bytes / 2**20:.1f}",
        "ulysses ms": f"{t_u * 1e3:.0f}",
        "ulysses E": f"{ideal / (n * t_u):.0%}",
        "hybrid u x r": f"{u} x {r}",
        "hybrid MiB": f"{h_bytes / 2**20:.1f}",
        "hybrid ms": f"{t_h * 1e3:.0f}",
        "hybrid E": f"{ideal / (n * t_h):.0%}",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=131072, help="sequence length S")
    parser.add_argument("--heads", type=int, default=32, help="query heads Nq")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads Nkv")
    parser.add_argument("--dim", type=int, default=128, help="head dim D")
    parser.add_argument("--bytes", type=int, default=2, help="bytes per element")
    parser.add_argument("--gflops", type=float, default=80.0, help="attention GFLOP/s per rank")
    parser.add_argument("--bandwidth", type=float, default=12.5, help="link GB/s per rank")
    parser.add_argument("--alpha-us", type=float, default=20.0, help="latency per message, us")
    args = parser.parse_args()
    scenarios = [
        ("given", args.gflops, args.bandwidth),
        # An accelerator-class rank: compute 5000x a core's, links 4x faster.
        ("accelerator", 400_000.0, 50.0),
    ]
    rows = []
    for name, gflops, bandwidth in scenarios:
        for n in (4, 8, 16, 32, 64):
            row = model(
                n,
                args.seq,
                args.heads,
                args.kv_heads,
                args.dim,
                args.bytes,
                gflops * 1e9,
                bandwidth * 1e9,
                args.alpha_us * 1e-6,
            )
            rows.append({"scenario": f"{name} (F={gflops:g}, B={bandwidth:g})", **row})
    notes = [
        f"Inputs: S={args.seq}, Nq={args.heads}, Nkv={args.kv_heads}, D={args.dim}, "
        f"{args.bytes} bytes per element, F={args.gflops} GFLOP/s per rank, "
        f"B={args.bandwidth} GB/s per rank, alpha={args.alpha_us} us (scenario 'given'); the "
        "'accelerator' scenario takes F=400000 GFLOP/s and B=50 GB/s. Forward, causal.",
        "",
        "Balance is the slowest rank's work over the mean. E is the single-rank time over n "
        "times the modelled time. The formulas are in the docstring of "
        "benchmarks/model_context_parallel.py. A ring step's compute/transfer ratio above 1 "
        "means the transfer hides behind the block's attention.",
        "",
        "This is a model, not a measurement: the machine line above is where it was printed.",
    ]
    print(write_results("context_parallel_model", rows, list(rows[0]), notes))


if __name__ == "__main__":
    main()
