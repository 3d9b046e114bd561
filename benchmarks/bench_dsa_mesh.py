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

``--v4``: one DeepSeek-V4 CSA layer instead: ``lightning_indexer`` over compressed keys (one
entry per 4 tokens, top-K entries), ``sparse_flash_mla`` over a window of 128 raw keys and the
picked entries with sinks (forward and backward for q, the raw keys, the entries and the sinks),
and the sparse KL loss over compressed keys (its target the attention's statistics); the raw
keys, the entries and the indexer's compressed keys sharded in head-tail order like the queries.
The compressed keys are inputs: the compressor runs data parallel, not on sharded tokens. The
key bytes each rank receives are measured at the all-gathers.

Run: ``.venv/bin/python benchmarks/bench_dsa_mesh.py [--seq 16384] [--world 4] [--v4]``.
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


RATIO, WINDOW = 4, 128  # DeepSeek-V4's CSA compression and raw-key window
V4_KEY_SIDE = ("key_index", "ori_kv", "cmp_kv")


def _inputs_v4(args):
    g = torch.Generator().manual_seed(0)
    s, c = args.seq, args.seq // RATIO

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    return dict(
        query_index=randn(1, s, args.heads, args.dim),
        key_index=randn(1, c, 1, args.dim),
        weights=randn(1, s, args.heads, scale=args.heads**-0.5),
        query=randn(1, s, args.attn_heads, args.attn_dim),
        ori_kv=randn(1, s, 1, args.attn_dim),
        cmp_kv=randn(1, c, 1, args.attn_dim),
        sinks=torch.zeros(args.attn_heads),
    )


def _step_v4(x, args, cached=False):
    """One training step of a V4 CSA layer on ``x`` (plain tensors or DTensors)."""
    scale = args.attn_dim**-0.5
    leaves = {n: v.detach().requires_grad_() for n, v in x.items()}
    cmp = dict(cmp_ratio=RATIO)
    block = opmesh.gather_once() if cached else contextlib.nullcontext()
    with block:
        if cached:
            for name in V4_KEY_SIDE:
                opmesh.prefetch_gather(leaves[name], 1)
        indices, _ = opmesh.lightning_indexer(
            leaves["query_index"], leaves["key_index"], leaves["weights"], sparse_count=args.topk,
            **cmp,
        )  # fmt: skip
        out, lse = opmesh.sparse_flash_mla(
            leaves["query"], ori_kv=leaves["ori_kv"], cmp_kv=leaves["cmp_kv"],
            cmp_sparse_indices=indices, sinks=leaves["sinks"], softmax_scale=scale,
            ori_win_left=WINDOW - 1, ori_win_right=0, return_softmax_lse=True, **cmp,
        )  # fmt: skip
        lse = lse.detach()
        loss = opmesh.sparse_indexer_kl_loss(
            leaves["query_index"], leaves["key_index"], leaves["weights"],
            leaves["query"].detach(), leaves["cmp_kv"].detach(), indices, lse,
            torch.ones_like(lse), scale, cmp_residual_key=None, **cmp,
        )  # fmt: skip
        total = out.float().sum() + loss.sum()
    if isinstance(total, opmesh.platform.current().DTensor):
        total = total.full_tensor()
    total.backward()


class _Received:
    """Counts the bytes this rank receives in all-gathers (DTensor's redistribute)."""

    def __init__(self, world):
        import torch.distributed._functional_collectives as funcol

        self.world, self.bytes = world, 0
        # DTensor's gathers go through one of these, by torch release.
        for name in ("all_gather_single", "all_gather_tensor"):
            own = getattr(funcol, name, None)
            if own is not None:
                setattr(funcol, name, self._counting(own))

    def _counting(self, own):
        def counted(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size() * (self.world - 1)
            return own(tensor, *args, **kwargs)

        return counted

    def take(self):
        out, self.bytes = self.bytes, 0
        return out


def _rank(rank, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        mesh = opmesh.init_device_mesh("cpu", (args.world,), mesh_dim_names=("cp",))
        x = _inputs_v4(args) if args.v4 else _inputs(args)
        step = _step_v4 if args.v4 else _step
        dx = {
            n: opmesh.distribute_tensor(
                opmesh.to_head_tail(v, 1, args.world, order=args.order), mesh, [opmesh.Shard(1)]
            )
            if n != "sinks"
            else opmesh.distribute_tensor(v, mesh, [opmesh.Replicate()])
            for n, v in x.items()
        }
        received = _Received(args.world)
        results = {}
        with opmesh.head_tail_cp(args.order):
            for cached in (False, True):
                received.take()
                step(dx, args, cached)  # one counted step
                results[("bytes", cached)] = received.take()
                results[cached] = _timed(
                    lambda cached=cached: step(dx, args, cached), args.repeats, dist.barrier
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


def _flops_v4(args):
    s, k = args.seq, args.topk
    entries = [(i + 1) // RATIO for i in range(s)]
    indexer = sum(entries) * 2 * args.heads * args.dim
    keys = sum(min(WINDOW, i + 1) + min(k, e) for i, e in enumerate(entries))
    attention = keys * 2 * 2 * args.attn_dim * args.attn_heads * 3.5
    selected = sum(min(k, e) for e in entries)
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
    parser.add_argument("--v4", action="store_true", help="a DeepSeek-V4 CSA layer")
    args = parser.parse_args()
    if args.v4 and (args.seq // RATIO) % (2 * args.world):
        parser.error(f"--v4: --seq / {RATIO} must be a multiple of {2 * args.world}")
    if args.seq % (2 * args.world):
        parser.error(f"--seq must be a multiple of {2 * args.world} (head-tail order)")

    torch.set_num_threads(1)
    x = _inputs_v4(args) if args.v4 else _inputs(args)
    step = _step_v4 if args.v4 else _step
    single = _timed(lambda: step(x, args), args.repeats)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out_path = os.path.join(tempfile.mkdtemp(), "dsa_mesh.pt")
    mp.start_processes(_rank, args=(port, args, out_path), nprocs=args.world, start_method="spawn")
    ranks = torch.load(out_path)

    flops = _flops_v4(args) if args.v4 else _flops(args)
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
        per_rank = ranks[("bytes", cached)]  # measured at the all-gathers
        rows.append(
            {
                "layout": f"{args.world} ranks x 1 thread, head-tail, {label}",
                "step ms": f"{t * 1e3:.0f}",
                "speed-up": f"{single / t:.2f}x",
                "GFLOP/s per rank": f"{flops / t / args.world / 1e9:.1f}",
                "key MiB received per rank": f"{per_rank / 2**20:.1f}",
            }
        )
    layer = (
        f"One DeepSeek-V4 CSA layer training step (entries of {RATIO} tokens, window {WINDOW}, "
        "the compressed keys given)"
        if args.v4
        else "One DSA layer training step"
    )
    notes = [
        f"{layer}, bf16, causal, S={args.seq}, K={args.topk}; indexer "
        f"{args.heads} heads x {args.dim}, attention {args.attn_heads} query heads / 1 key "
        f"head x {args.attn_dim}; head-tail order {args.order!r}; median of {args.repeats} "
        "step(s) after a warm-up; each rank a process (gloo) with 1 thread; key bytes received "
        "per rank measured at the all-gathers of one step.",
        "",
        f"Machine cores: {os.cpu_count()}; with fewer cores than ranks the ranks share them and "
        "the speed-up is bounded by the cores, not by the ranks.",
    ]
    name = f"dsa_mesh_{'v4_' if args.v4 else ''}{args.world}ranks"
    print(write_results(name, rows, list(rows[0]), notes))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
