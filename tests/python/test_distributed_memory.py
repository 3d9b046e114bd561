"""The distributed layer's memo tables stay bounded: a stream of distinct global shapes (every
batch of varlen training is new) must not grow memory. Runs on a one-rank gloo mesh in a child
process, so this test process keeps no process group."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, socket, tracemalloc
    import torch
    import torch.distributed as dist
    import opmesh
    from torch.distributed.tensor import DTensor
    from opmesh.distributed import DISPATCHER
    from opmesh.distributed.distributed_op import get_distributed_op
    from opmesh.platform import current

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = opmesh.init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    R, S1 = opmesh.Replicate(), opmesh.Shard(1)
    k = torch.randn(1, 4, 1, 8)

    dk = opmesh.distribute_tensor(k, mesh, [R])

    def call(s1):
        q = torch.randn(1, s1, 2, 8)
        w = torch.randn(1, s1, 2)
        return opmesh.dense_lightning_indexer_softmax_lse(
            DTensor.from_local(q, mesh, [S1], run_check=False),
            dk,
            DTensor.from_local(w, mesh, [S1], run_check=False),
            sparse_mode=0,
        )

    for s1 in range(1, 2001):
        call(s1)
    # Tracing from here on: by 3000 every bounded table holds only entries made while traced, so
    # from then on what is traced is exactly what stays.
    tracemalloc.start()
    for s1 in range(2001, 3001):
        call(s1)
    before = tracemalloc.get_traced_memory()[0]
    for s1 in range(3001, 10001):
        call(s1)
    growth = tracemalloc.get_traced_memory()[0] - before
    platform = current()
    sizes = [
        DISPATCHER.cache_size(),
        len(get_distributed_op("dense_lightning_indexer_softmax_lse")._checked),
        len(platform._specs),
        len(platform._offsets),
    ]
    print("GROWTH", growth, "SIZES", *sizes, flush=True)
    dist.destroy_process_group()
    # DTensor's caches hold the mesh and its gloo worker threads until the interpreter shuts
    # down, where one still letting go of a collective's tensors aborts the process.
    os._exit(0)
    """
)


def test_caches_stay_bounded_over_10000_distinct_shapes():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("GROWTH"))
    fields = line.split()
    growth = int(fields[1])
    sizes = [int(x) for x in fields[3:]]
    assert max(sizes) <= 256, f"a memo table holds {max(sizes)} entries: {sizes}"
    # 7000 new shapes: unbounded tables grew by several MB here; bounded ones stay flat.
    assert growth < 256 * 1024, f"memory grew by {growth} bytes over 7000 new shapes"
