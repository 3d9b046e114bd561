"""Runs a module's mesh cases on real process groups (gloo, spawned processes) and collects
their results: shared by test_distributed.py and test_flash_attn_mesh.py.

A cases function takes the device mesh and returns {name: callable}; a case raises on failure.
Every rank runs every case; a case passes when it passed on every rank, otherwise the first
failure's traceback is kept.
"""

from __future__ import annotations

import datetime
import importlib
import json
import math
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import opmesh


def expect_error(exc, prefix, fn):
    """The call raises `exc` whose message starts with `prefix` (the argument's name first)."""
    try:
        fn()
    except exc as e:
        assert str(e).startswith(prefix), f"message {str(e)!r} does not start with {prefix!r}"
        return
    raise AssertionError(f"expected {exc.__name__} starting with {prefix!r}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port, shape, names, out_dir, module, function):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # A rank left waiting in a collective (another rank raised before it) fails the case in
    # minutes instead of hanging the suite.
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    try:
        mesh = opmesh.init_device_mesh("cpu", shape, mesh_dim_names=names)
        cases = getattr(importlib.import_module(module), function)(mesh)
        results = {}
        for name, fn in cases.items():
            try:
                fn()
                results[name] = "ok"
            except Exception as e:  # reported per case by the parent test
                results[name] = f"rank {rank}: {traceback.format_exc()}"
                outcome = f"{type(e).__name__}: {e}"
            else:
                outcome = "ok"
            # A call either succeeds on every rank or raises the same error on every rank.
            outcomes = [None] * world
            dist.all_gather_object(outcomes, outcome)
            if len(set(outcomes)) > 1:
                disagreement = "ranks disagree: " + "; ".join(
                    f"rank {r}: {o}" for r, o in enumerate(outcomes)
                )
                mine = results[name]
                results[name] = disagreement + ("" if mine == "ok" else "\n" + mine)
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            merged = {}
            for per_rank in gathered:
                for name, status in per_rank.items():
                    if merged.get(name, "ok") == "ok":
                        merged[name] = status
            with open(os.path.join(out_dir, "results.json"), "w") as f:
                json.dump(merged, f)
        # Every rank reaches this point before any tears its groups down: a rank that leaves
        # early takes the store others still talk to.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # DTensor's caches hold the mesh, and with it gloo's worker threads, until the interpreter
    # shuts down, where a worker still letting go of a collective's tensors can abort the
    # process after every case has run: leave without the interpreter's finalisation.
    os._exit(0)


def run_cases(out_dir, shape, names, module, function):
    """Spawns one process per rank of a mesh `shape` (axis `names`), runs
    ``module.function(mesh)``'s cases there and returns {case: "ok" or the failure}."""
    world = math.prod(shape)
    here = os.path.dirname(os.path.abspath(__file__))
    # Spawned ranks import the cases module from this folder.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, saved]))
    try:
        # A fresh port per attempt; a second attempt only when the first process group could
        # not be set up or torn down (a crashed rank), never to retry a failing case: case
        # failures are reported in results.json, not by the exit status.
        for attempt in range(2):
            try:
                mp.start_processes(
                    worker,
                    args=(world, _free_port(), shape, names, str(out_dir), module, function),
                    nprocs=world,
                    join=True,
                    start_method="spawn",
                )
                break
            except mp.ProcessExitedException:
                if attempt == 1:
                    raise
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    with open(os.path.join(out_dir, "results.json")) as f:
        return json.load(f)
