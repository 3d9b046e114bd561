"""One DeepSeek-sparse-attention layer on n ranks (context parallel) against one rank.

The layer, as a training step: ``lightning_indexer`` (the top-K keys of every token),
``sparse_flash_attention`` over them (forward, and backward for query, key and value), and the
sparse KL loss ``sparse_indexer_kl_loss`` (forward, and backward for the indexer's inputs);
bf16, one causal sequence of S tokens (default 16384, K = 512), indexer 64 heads x 128, main
attention 16 query heads over 1 key head x 128 (the shapes of bench_dsa.py).

On the mesh (``--world`` ranks, default 4, one process each over gloo, 1 thread) every tensor is
sharded along the sequence in head-tail order, keys included (as a model computes them from
sequence-sharded hidden states): the ops gather the keys inside. Two variants: each op
gathering its own keys, and the step inside ``opmesh.gather_once()`` with the keys prefetched
(one all-gather per key per step). A timed step starts and ends with a barrier, so its time is
the slowest rank's. The one-rank step runs the same layer on whole tensors with 1 thread.

Also reported: the layer's FLOPs per second (the indexer's visible score entries x 2 N1 D, the
attention's selected entries x 2 (D + Dv) N1 forward and 2.5 times that backward, the KL loss's
selected entries x 2 D (N1 + 3 N1 index)), and the key bytes each rank receives per step.

Run: ``.venv/bin/python benchmarks/bench_dsa_mesh.py [--seq 16384] [--world 4]``.
"""

from __future__ import annotations

import argparse
import contextlib
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

QUERY_SIDE = ("query_index", "weights", "query")
KEY_SIDE = ("key_index", "key", "value")


def _inputs(args):
    g = torch.Generator().manual_seed(0)
    s = args.seq

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    return dict(
        query_index=randn(1, s, args.heads, args.dim),
        key_index=randn(1, s, 1, args.dim),
        weights=randn(1, s, args.heads, scale=args.heads**-0.5),
        query=randn(1, s, args.attn_heads, args.attn_dim),
        key=randn(1, s, 1, args.attn_dim),
        value=randn(1, s, 1, args.attn_dim),
    )


def _step(x, args, cached=False):
    """One training step of the layer on ``x`` (plain tensors or DTensors)."""
    scale = args.attn_dim**-0.5
    leaves = {n: v.detach().requires_grad_() for n, v in x.items()}
    block = opmesh.gather_once() if cached else contextlib.nullcontext()
    with block:
        if cached:
            for name in KEY_SIDE:
                opmesh.prefetch_gather(leaves[name], 1)
        indices, _ = opmesh.lightning_indexer(
            leaves["query_index"], leaves["key_index"], leaves["weights"], sparse_count=args.topk
        )
        out, smax, ssum = opmesh.sparse_flash_attention(
            leaves["query"], leaves["key"], leaves["value"], indices, scale,
            return_softmax_lse=True,
        )  # fmt: skip
        loss = opmesh.sparse_indexer_kl_loss(
            leaves["query_index"], leaves["key_index"], leaves["weights"],
            leaves["query"].detach(), leaves["key"].detach(), indices, smax, ssum, scale,
        )  # fmt: skip
        total = out.float().sum() + loss.sum()
    if isinstance(total, opmesh.platform.current().DTensor):
        total = total.full_tensor()
    total.backward()


def _rank(rank, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        mesh = opmesh.init_device_mesh("cpu", (args.world,), mesh_dim_names=("cp",))
        x = _inputs(args)
        dx = {
            n: opmesh.distribute_tensor(
                opmesh.to_head_tail(v, 1, args.world, order=args.order), mesh, [opmesh.Shard(1)]
            )
            for n, v in x.items()
        }
        results = {}
        with opmesh.head_tail_cp(args.order):
            for cached in (False, True):
                results[cached] = _timed(
                    lambda cached=cached: _step(dx, args, cached), args.repeats, dist.barrier
                )
        if rank == 0:
            torch.save(results, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_rank()


def _flops(args):
    s, k = args.seq, args.topk
    visible = s * (s + 1) / 2
    selected = sum(min(k, i + 1) for i in range(s))
    indexer = visible * 2 * args.heads * args.dim
    attention = selected * 2 * 2 * args.attn_dim * args.attn_heads * 3.5
    kl = selected * 2 * (args.attn_heads * args.attn_dim + 3 * args.heads * args.dim)
    return indexer + attention + kl


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=16384, help="sequence length S")
    parser.add_argument("--topk", type=int, default=512, help="K")
    parser.add_argument("--world", type=int, default=4, help="ranks (processes)")
    parser.add_argument("--heads", type=int, default=64, help="indexer query heads")
    parser.add_argument("--dim", type=int, default=128, help="indexer head dim")
    parser.add_argument("--attn-heads", type=int, default=16, help="main attention query heads")
    parser.add_argument("--attn-dim", type=int, default=128, help="main attention head dim")
    parser.add_argument("--order", default="opmesh", choices=("opmesh", "hyperparallel"))
    parser.add_argument("--repeats", type=int, default=1, help="timed steps per measurement")
    args = parser.parse_args()
    if args.seq % (2 * args.world):
        parser.error(f"--seq must be a multiple of {2 * args.world} (head-tail order)")

    torch.set_num_threads(1)
    x = _inputs(args)
    single = _timed(lambda: _step(x, args), args.repeats)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out_path = os.path.join(tempfile.mkdtemp(), "dsa_mesh.pt")
    mp.start_processes(_rank, args=(port, args, out_path), nprocs=args.world, start_method="spawn")
    ranks = torch.load(out_path)

    flops = _flops(args)
    key_bytes = sum(x[n].numel() * x[n].element_size() for n in KEY_SIDE)
    received = key_bytes * (args.world - 1) / args.world
    rows = [
        {
            "layout": "1 rank x 1 thread",
            "step ms": f"{single * 1e3:.0f}",
            "speed-up": "1.00x",
            "GFLOP/s per rank": f"{flops / single / 1e9:.1f}",
            "key MiB received per rank": "0",
        }
    ]
    for cached, label in ((False, "each op gathers"), (True, "gather_once + prefetch")):
        t = ranks[cached]
        # Without the cache key_index and key are gathered twice (indexer and KL, attention
        # and KL): 5 gathers of the 3 equally sized keys instead of 3.
        per_rank = received * (1 if cached else 5 / 3)
        rows.append(
            {
                "layout": f"{args.world} ranks x 1 thread, head-tail, {label}",
                "step ms": f"{t * 1e3:.0f}",
                "speed-up": f"{single / t:.2f}x",
                "GFLOP/s per rank": f"{flops / t / args.world / 1e9:.1f}",
                "key MiB received per rank": f"{per_rank / 2**20:.1f}",
            }
        )
    notes = [
        f"One DSA layer training step, bf16, causal, S={args.seq}, K={args.topk}; indexer "
        f"{args.heads} heads x {args.dim}, attention {args.attn_heads} query heads / 1 key "
        f"head x {args.attn_dim}; head-tail order {args.order!r}; median of {args.repeats} "
        "step(s) after a warm-up; each rank a process (gloo) with 1 thread.",
        "",
        f"Machine cores: {os.cpu_count()}; with fewer cores than ranks the ranks share them and "
        "the speed-up is bounded by the cores, not by the ranks.",
    ]
    name = f"dsa_mesh_{args.world}ranks"
    print(write_results(name, rows, list(rows[0]), notes))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
