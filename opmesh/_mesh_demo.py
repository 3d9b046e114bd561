"""``python -m opmesh mesh-demo``: the indexer on a (2, 4) mesh of local processes (gloo),
data parallel over "dp" and context parallel over "cp", printing each output's placements and the
error against the single-device run."""

from __future__ import annotations

import logging
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import opmesh
from opmesh import Replicate, Shard


def _inputs(layout):
    g = torch.Generator().manual_seed(0)
    if layout == "BSND":
        return (
            torch.randn(2, 256, 16, 64, generator=g),
            torch.randn(2, 320, 1, 64, generator=g),
            torch.randn(2, 256, 16, generator=g) / 32,
            {},
        )
    lengths = [100, 7, 300, 105]
    cu = torch.tensor(lengths).cumsum(0)
    return (
        torch.randn(sum(lengths), 16, 64, generator=g),
        torch.randn(sum(lengths), 1, 64, generator=g),
        torch.randn(sum(lengths), 16, generator=g) / 32,
        dict(actual_seq_qlen=cu, actual_seq_klen=cu, layout="TND"),
    )


def _rank_main(rank, world, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    # Gathering a tensor sharded over both mesh axes for the comparison takes two all-gathers;
    # torch warns about that on every rank.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = opmesh.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "cp"))
    runs = {
        "BSND, batch over dp, queries over cp": (
            "BSND",
            [Shard(0), Shard(1)],
            [Shard(0), Replicate()],
            False,
        ),
        "BSND, head-tail order over cp": (
            "BSND",
            [Shard(0), Shard(1)],
            [Shard(0), Replicate()],
            True,
        ),
        "TND varlen, tokens over dp x cp": (
            "TND",
            [Shard(0), Shard(0)],
            [Replicate(), Replicate()],
            False,
        ),
    }
    for title, (layout, q_place, k_place, head_tail) in runs.items():
        q, k, w, kw = _inputs(layout)
        want = opmesh.dense_lightning_indexer_softmax_lse(q, k, w, **kw)
        if head_tail:
            q, w = opmesh.to_head_tail(q, 1, 4), opmesh.to_head_tail(w, 1, 4)
        dq = opmesh.distribute_tensor(q, mesh, q_place)
        dk = opmesh.distribute_tensor(k, mesh, k_place)
        dw = opmesh.distribute_tensor(w, mesh, q_place)
        if head_tail:
            with opmesh.head_tail_cp():
                got = opmesh.dense_lightning_indexer_softmax_lse(dq, dk, dw, **kw)
            full = [opmesh.from_head_tail(g.full_tensor(), 2, 4) for g in got]
        else:
            got = opmesh.dense_lightning_indexer_softmax_lse(dq, dk, dw, **kw)
            full = [g.full_tensor() for g in got]
        finite = torch.isfinite(want[0])
        err = max(
            ((f - w_) / w_.abs().clamp_min(1e-6))[finite].abs().max().item()
            for f, w_ in zip(full, want, strict=True)
        )
        if rank == 0:
            print(
                f"  {title}:\n    query_index {tuple(q.shape)} placements {tuple(dq.placements)}"
                f"\n    softmax_max {tuple(got[0].shape)} placements {tuple(got[0].placements)},"
                f" local shard {tuple(got[0].to_local().shape)}\n    max relative error vs "
                f"single device: {err:.1e}"
            )
    dist.barrier()
    dist.destroy_process_group()
    # DTensor's caches hold the mesh, and with it gloo's worker threads, until the interpreter
    # shuts down, where a worker still letting go of a collective's tensors aborts the process:
    # leave without the interpreter's finalisation.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_mesh_demo():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print("\ndense_lightning_indexer_softmax_lse on a (2, 4) mesh ('dp', 'cp'), 8 gloo processes:")
    mp.start_processes(_rank_main, args=(8, port), nprocs=8, join=True, start_method="spawn")
