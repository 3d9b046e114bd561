"""Per-call overhead of an opmesh call on DTensors through the dispatcher (warm layout cache)
against the plain local call and against PyTorch's own DTensor paths for the same custom op, in
one run: local_map (a function run on local shards) and register_sharding (a sharding rule for
the op itself).

The op is the indexer on tiny inputs, so the times are almost all dispatch; overhead is the
difference to the raw op call. Also reports the causal work per context-parallel rank with and
without head-tail order.

    python benchmarks/bench_dispatch.py
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import local_map, register_sharding

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

import opmesh  # noqa: E402
from opmesh.distributed.context_parallel import causal_work_per_rank  # noqa: E402

OP = torch.ops.opmesh.dense_lightning_indexer_softmax_lse.default


def per_call_us(fn, calls=3000):
    for _ in range(200):
        fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        samples.append((time.perf_counter() - t0) / (calls // 5) * 1e6)
    return statistics.median(samples)


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = opmesh.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, 8, 16, generator=g)
    k = torch.randn(1, 16, 1, 16, generator=g)
    w = torch.randn(1, 16, 8, generator=g)
    place = (Shard(0),)
    dq, dk, dw = (opmesh.distribute_tensor(x, mesh, place) for x in (q, k, w))

    mapped = local_map(
        partial(OP, layout="BSND", sparse_mode=3),
        out_placements=((Shard(0),), (Shard(0),)),
        in_placements=(place, place, place),
    )

    @register_sharding(OP)
    def _indexer_sharding(
        query_index,
        key_index,
        weights,
        actual_seq_qlen=None,
        actual_seq_klen=None,
        layout="BSND",
        sparse_mode=3,
    ):
        batch = ([Shard(0), Shard(0)], [Shard(0), Shard(0), Shard(0), None, None, None, None])
        replicated = (
            [Replicate(), Replicate()],
            [Replicate(), Replicate(), Replicate(), None, None, None, None],
        )
        return [batch, replicated]

    times = {
        "raw op, local tensors": per_call_us(lambda: OP(q, k, w)),
        "opmesh function, local tensors": per_call_us(
            lambda: opmesh.dense_lightning_indexer_softmax_lse(q, k, w)
        ),
        "opmesh function, DTensors": per_call_us(
            lambda: opmesh.dense_lightning_indexer_softmax_lse(dq, dk, dw)
        ),
        "torch local_map, DTensors": per_call_us(lambda: mapped(dq, dk, dw)),
        "torch register_sharding, DTensors": per_call_us(lambda: OP(dq, dk, dw)),
    }
    base = times["raw op, local tensors"]
    lm = times["torch local_map, DTensors"] - base
    rs = times["torch register_sharding, DTensors"] - base
    rows = []
    for method, t in times.items():
        overhead = t - base
        dtensor = "DTensors" in method
        rows.append(
            {
                "path": method,
                "us per call": f"{t:.1f}",
                "overhead us": f"{overhead:.1f}",
                "overhead / local_map's": f"{overhead / lm:.0%}" if dtensor else "",
                "overhead / register_sharding's": f"{overhead / rs:.0%}" if dtensor else "",
            }
        )
        print(rows[-1], flush=True)
    balance = []
    for cp in (2, 4, 8):
        for head_tail in (False, True):
            work = causal_work_per_rank(8192, 8192, cp, head_tail)
            balance.append(
                f"cp={cp} {'head-tail' if head_tail else 'contiguous'}: per-rank "
                f"work max/mean {max(work) / statistics.mean(work):.3f}, "
                f"max/min {max(work) / min(work):.2f}"
            )
    print("\n".join(balance))
    write_results(
        "dispatch",
        rows,
        list(rows[0]),
        notes=[
            "Indexer on [1, 16, 8, 16] inputs, a one-rank gloo mesh; overhead = time - raw op "
            "time.",
            "",
            "Causal work per context-parallel rank (S1 = S2 = 8192), visible query-key pairs:",
            *[f"- {line}" for line in balance],
            "",
            "`.venv/bin/python benchmarks/bench_dispatch.py`",
        ],
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
