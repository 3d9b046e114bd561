"""Context parallel flash_attn: 2 ranks x 1 thread against 1 rank x 1 thread.

Causal bf16 attention of one long sequence (default S=8192, 8 query / 2 key heads, D=128),
forward and forward+backward, for each strategy: all-gather in sequence order, all-gather in
head-tail order, and ring. Each rank runs in its own process (gloo) with one thread; a timed
call starts and ends with a barrier, so its time is the slowest rank's. The speed-up is the
one-rank time over the two-rank time.

Also reported:
- bytes each rank sends: its key and value shards, once per other rank, for both strategies
  (from the shapes: all-gather sends each shard to every other rank, the ring passes n - 1
  chunks on);
- for the ring, how much of its communication the computation hides: ``hidden = (compute +
  communication - ring) / communication``, where compute is the slowest rank's attention work
  alone (its rows against the keys it sees, keys already local) and communication is the n - 1
  ring transfers alone, both timed on the same ranks.

Run: ``.venv/bin/python benchmarks/bench_context_parallel.py [--seq 8192]``; results go to
benchmarks/results/context_parallel*.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

import opmesh  # noqa: E402

WORLD = 2


def _inputs(args, requires_grad=False):
    g = torch.Generator().manual_seed(0)

    def make(n):
        x = torch.randn(1, args.seq, n, args.dim, generator=g).to(torch.bfloat16)
        return x.requires_grad_(requires_grad)

    return make(args.heads), make(args.kv_heads), make(args.kv_heads)


def _timed(fn, repeats, sync=None):
    """Median seconds of fn() after one warm-up call, each call between two barriers."""
    fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step(call, backward):
    def run():
        with torch.set_grad_enabled(backward):
            out, _ = call()
            if backward:
                out.float().sum().backward()

    return run


def _single(args):
    torch.set_num_threads(1)
    times = {}
    for backward in (False, True):
        q, k, v = _inputs(args, requires_grad=backward)
        call = _step(lambda q=q, k=k, v=v: opmesh.flash_attn(q, k, v, mask_mode=3), backward)
        times[backward] = _timed(call, args.repeats)
    return times


def _rank(rank, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = opmesh.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
        sync = dist.barrier
        results = {}
        for strategy, order in (("all_gather", None), ("all_gather", "opmesh"), ("ring", None)):
            for backward in (False, True):
                q, k, v = _inputs(args)
                if order:
                    q, k, v = (opmesh.to_head_tail(x, 1, WORLD, order=order) for x in (q, k, v))
                dq, dk, dv = (
                    opmesh.distribute_tensor(x, mesh, [opmesh.Shard(1)]).requires_grad_(backward)
                    for x in (q, k, v)
                )

                def call(dq=dq, dk=dk, dv=dv, strategy=strategy, order=order):
                    if order:
                        with opmesh.head_tail_cp(order):
                            return opmesh.flash_attn(
                                dq, dk, dv, mask_mode=3, context_parallel=strategy
                            )
                    return opmesh.flash_attn(dq, dk, dv, mask_mode=3, context_parallel=strategy)

                key = f"{strategy}{'+head_tail' if order else ''}"
                results[(key, backward)] = _timed(_step(call, backward), args.repeats, sync)
        # The ring's parts alone: the slowest rank's attention with its keys already local, and
        # the n - 1 transfers of a key and value chunk.
        q, k, v = _inputs(args)
        rows = args.seq // WORLD
        mine = slice(rank * rows, (rank + 1) * rows)
        seen = torch.tensor([(rank + 1) * rows], dtype=torch.int32)

        def compute():
            opmesh.flash_attn(q[:, mine], k, v, mask_mode=3, seqused_kv=seen)

        t_compute = _timed(compute, args.repeats)
        worst = [None] * WORLD
        dist.all_gather_object(worst, t_compute)
        chunk_k, chunk_v = k[:, mine].contiguous(), v[:, mine].contiguous()

        def transfers():
            for _ in range(WORLD - 1):
                ops = []
                for t in (chunk_k, chunk_v):
                    ops.append(dist.P2POp(dist.isend, t, (rank + 1) % WORLD))
                    ops.append(dist.P2POp(dist.irecv, torch.empty_like(t), (rank - 1) % WORLD))
                for request in dist.batch_isend_irecv(ops):
                    request.wait()

        t_comm = _timed(transfers, args.repeats, sync)
        results["ring_compute"] = max(worst)
        results["ring_transfers"] = t_comm
        results["bytes_per_rank"] = (WORLD - 1) * 2 * chunk_k.numel() * chunk_k.element_size()
        if rank == 0:
            torch.save(results, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192, help="sequence length S")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--dim", type=int, default=128, help="head dim D")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement")
    args = parser.parse_args()
    if args.seq % (2 * WORLD):
        parser.error(f"--seq must be a multiple of {2 * WORLD} (head-tail order)")

    single = _single(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = os.path.join(tempfile.mkdtemp(), "cp.pt")
    mp.start_processes(_rank, args=(port, args, out_path), nprocs=WORLD, start_method="spawn")
    ranks = torch.load(out_path)

    flops = 4 * args.heads * args.dim * args.seq * (args.seq + 1) / 2  # causal forward
    rows = []
    for key in ("all_gather", "all_gather+head_tail", "ring"):
        for backward in (False, True):
            t1, t2 = single[backward], ranks[(key, backward)]
            work = flops * (3.5 if backward else 1.0)  # backward: 2.5 forward's products
            rows.append(
                {
                    "strategy": key,
                    "pass": "forward+backward" if backward else "forward",
                    "1 rank ms": f"{t1 * 1e3:.0f}",
                    "2 ranks ms": f"{t2 * 1e3:.0f}",
                    "speed-up": f"{t1 / t2:.2f}x",
                    "GFLOP/s per rank": f"{work / t2 / WORLD / 1e9:.1f}",
                    "MiB sent per rank": f"{ranks['bytes_per_rank'] / 2**20:.1f}",
                }
            )
    compute, comm = ranks["ring_compute"], ranks["ring_transfers"]
    ring_forward = ranks[("ring", False)]
    hidden = max(0.0, min(1.0, (compute + comm - ring_forward) / comm)) if comm > 0 else 1.0
    notes = [
        f"Causal bf16, S={args.seq}, {args.heads} query / {args.kv_heads} key heads, "
        f"D={args.dim}; {WORLD} ranks x 1 thread (gloo, one process each) against 1 rank x 1 "
        "thread; median of "
        f"{args.repeats} calls after a warm-up.",
        "",
        f"Ring forward: slowest rank's attention alone {compute * 1e3:.0f} ms, its "
        f"{WORLD - 1} key/value transfer(s) alone {comm * 1e3:.1f} ms, the ring "
        f"{ring_forward * 1e3:.0f} ms: {hidden:.0%} of the communication hidden behind compute.",
        "",
        "Bytes sent per rank are the key and value shards (bf16) each rank passes on, the same "
        "for both strategies at this size; they come from the shapes.",
    ]
    print(write_results("context_parallel", rows, list(rows[0]), notes))


if __name__ == "__main__":
    main()
