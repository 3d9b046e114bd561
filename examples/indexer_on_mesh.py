"""The indexer on a device mesh, launched by torchrun (one process per rank).

    # one machine, 8 processes:
    torchrun --standalone --nproc-per-node 8 examples/indexer_on_mesh.py
    # two machines, 4 processes each (run on both, node-rank 0 and 1):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 \
        --rdzv-backend c10d --rdzv-endpoint first-host:29500 examples/indexer_on_mesh.py
"""

import os
import sys

import torch
import torch.distributed as dist

import opmesh
from opmesh import Replicate, Shard


def main():
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    world = dist.get_world_size()
    dp = 2 if world % 2 == 0 else 1
    mesh = opmesh.init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "cp"))
    g = torch.Generator().manual_seed(0)  # the same global tensors on every rank
    q = torch.randn(2, 1024, 16, 64, generator=g)
    k = torch.randn(2, 1024, 1, 64, generator=g)
    w = torch.randn(2, 1024, 16, generator=g) / 32
    dq = opmesh.distribute_tensor(q, mesh, [Shard(0), Shard(1)])  # batch over dp, queries cp
    dk = opmesh.distribute_tensor(k, mesh, [Shard(0), Replicate()])
    dw = opmesh.distribute_tensor(w, mesh, [Shard(0), Shard(1)])
    softmax_max, softmax_sum = opmesh.dense_lightning_indexer_softmax_lse(dq, dk, dw)
    full = softmax_max.full_tensor()
    if int(os.environ.get("RANK", "0")) == 0:
        want = opmesh.dense_lightning_indexer_softmax_lse(q, k, w)[0]
        print(
            f"placements {softmax_max.placements}, equal to one device: {torch.equal(full, want)}"
        )
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # DTensor's caches hold the mesh, and with it gloo's worker threads, until the interpreter
    # shuts down, where a worker still letting go of a collective's tensors aborts the process:
    # leave without the interpreter's finalisation (see train_context_parallel.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
