"""Context parallel flash_attn: n ranks x 1 thread (``--world``, default 2) against 1 rank x 1
thread.

Causal bf16 attention of one long sequence (default S=8192, 8 query / 2 key heads, D=128),
forward and forward+backward, for each strategy: all-gather in sequence order, all-gather in
head-tail order, ring, Ulysses (all-to-all) in sequence and head-tail order, and, for an even
n >= 4, the two-axis hybrids of Ulysses with ring and with all-gather on a (2, n / 2) mesh.
Each rank runs in its own process (gloo) with one thread; a timed call starts and ends with a
barrier, so its time is the slowest rank's. The speed-up is the one-rank time over the n-rank
time.

Also reported:
- bytes each rank sends in the forward, from the shapes: all-gather and ring send the rank's
  key and value shards to / through the n - 1 others; Ulysses sends (n - 1) / n of its q, k,
  v shards (key heads repeated as far as the split needs) and of its output; the hybrid sends
  Ulysses' share over the first axis and the ring's (or all-gather's) over the second. (The
  hybrid's first exchange goes through DTensor, whose gloo path is an all-gather and a slice,
  which sends more than this count);
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
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import leave_rank, write_results  # noqa: E402
from common import timed_between_barriers as _timed  # noqa: E402

import opmesh  # noqa: E402

WORLD = 2  # set from --world in each process


def _inputs(args, requires_grad=False):
    g = torch.Generator().manual_seed(0)

    def make(n):
        x = torch.randn(1, args.seq, n, args.dim, generator=g).to(torch.bfloat16)
        return x.requires_grad_(requires_grad)

    return make(args.heads), make(args.kv_heads), make(args.kv_heads)


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


def _strategies(world):
    """(name, context_parallel, head-tail order, mesh shape) of every strategy run on ``world``
    ranks."""
    out = [
        ("all_gather", "all_gather", None, (world,)),
        ("all_gather+head_tail", "all_gather", "opmesh", (world,)),
        ("ring", "ring", None, (world,)),
        ("ulysses", "ulysses", None, (world,)),
        ("ulysses+head_tail", "ulysses", "opmesh", (world,)),
    ]
    if world >= 4 and world % 2 == 0:
        out += [
            ("ulysses x ring", ("ulysses", "ring"), None, (2, world // 2)),
            ("ulysses x all_gather", ("ulysses", "all_gather"), None, (2, world // 2)),
        ]
    return out


def _rank(rank, port, args, out_path):
    global WORLD
    WORLD = args.world
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        meshes = {}
        sync = dist.barrier
        results = {}
        for key, strategy, order, shape in _strategies(WORLD):
            if shape not in meshes:
                names = ("cp",) if len(shape) == 1 else ("u", "r")
                meshes[shape] = opmesh.init_device_mesh("cpu", shape, mesh_dim_names=names)
            mesh = meshes[shape]
            placements = [opmesh.Shard(1)] * len(shape)
            for backward in (False, True):
                q, k, v = _inputs(args)
                if order:
                    q, k, v = (opmesh.to_head_tail(x, 1, WORLD, order=order) for x in (q, k, v))
                dq, dk, dv = (
                    opmesh.distribute_tensor(x, mesh, placements).requires_grad_(backward)
                    for x in (q, k, v)
                )

                def call(dq=dq, dk=dk, dv=dv, strategy=strategy, order=order):
                    if order:
                        with opmesh.head_tail_cp(order):
                            return opmesh.flash_attn(
                                dq, dk, dv, mask_mode=3, context_parallel=strategy
                            )
                    return opmesh.flash_attn(dq, dk, dv, mask_mode=3, context_parallel=strategy)

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
        results["bytes"] = _bytes_per_rank(args, WORLD)
        if rank == 0:
            torch.save(results, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_rank()


def _bytes_per_rank(args, world):
    """Bytes each rank sends in one forward, per strategy (see the module's text)."""
    from math import ceil

    item = 2  # bf16
    rows = ceil(args.seq / world)
    kv = 2 * rows * args.kv_heads * args.dim * item  # its key and value shards
    gathered = (world - 1) * kv
    group = args.heads // args.kv_heads
    repeat = next(
        r
        for r in range(1, group + 1)
        if group % r == 0
        and ceil(args.heads / world) == (group // r) * ceil(args.kv_heads * r / world)
    )

    def ulysses(n, rows_):
        q_out = 2 * rows_ * args.heads * args.dim * item
        k_v = 2 * rows_ * args.kv_heads * repeat * args.dim * item
        return (n - 1) * (q_out + k_v) // n

    out = {
        "all_gather": gathered,
        "all_gather+head_tail": gathered,
        "ring": gathered,
        "ulysses": ulysses(world, rows),
        "ulysses+head_tail": ulysses(world, rows),
    }
    if world >= 4 and world % 2 == 0:
        r = world // 2
        # Ulysses over 2 ranks on the (u, r) shard, then the keys and values of half the heads
        # (every head repeated as for 2 ranks) over the r ranks of the second axis.
        second = (
            (r - 1) * 2 * ceil(args.seq / r) * ceil(args.kv_heads * repeat / 2) * args.dim * item
        )
        out["ulysses x ring"] = out["ulysses x all_gather"] = ulysses(2, rows) + second
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192, help="sequence length S")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--dim", type=int, default=128, help="head dim D")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement")
    parser.add_argument("--world", type=int, default=2, help="ranks (processes)")
    args = parser.parse_args()
    global WORLD
    WORLD = args.world
    if args.seq % (2 * WORLD):
        parser.error(f"--seq must be a multiple of {2 * WORLD} (head-tail order)")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")

    single = _single(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = os.path.join(tempfile.mkdtemp(), "cp.pt")
    mp.start_processes(_rank, args=(port, args, out_path), nprocs=WORLD, start_method="spawn")
    ranks = torch.load(out_path)

    flops = 4 * args.heads * args.dim * args.seq * (args.seq + 1) / 2  # causal forward
    rows = []
    for key, *_ in _strategies(WORLD):
        for backward in (False, True):
            t1, t2 = single[backward], ranks[(key, backward)]
            work = flops * (3.5 if backward else 1.0)  # backward: 2.5 forward's products
            rows.append(
                {
                    "strategy": key,
                    "pass": "forward+backward" if backward else "forward",
                    "1 rank ms": f"{t1 * 1e3:.0f}",
                    f"{WORLD} ranks ms": f"{t2 * 1e3:.0f}",
                    "speed-up": f"{t1 / t2:.2f}x",
                    "GFLOP/s per rank": f"{work / t2 / WORLD / 1e9:.1f}",
                    "MiB sent per rank (forward)": f"{ranks['bytes'][key] / 2**20:.1f}",
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
        "Bytes sent per rank (forward) come from the shapes (the module's text); all-gather "
        "and Ulysses do not overlap their exchanges with compute, the ring does (above). The "
        "hybrids' first exchange runs through DTensor, whose gloo path is an all-gather and a "
        "slice: it sends more than the count shown.",
    ]
    name = "context_parallel" if WORLD == 2 else f"context_parallel_{WORLD}ranks"
    print(write_results(name, rows, list(rows[0]), notes))


if __name__ == "__main__":
    main()
