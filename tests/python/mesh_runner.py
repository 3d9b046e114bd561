"""Runs the mesh cases on real process groups (gloo, spawned processes) and collects their
results, for test_distributed.py, test_dsa_mesh.py, test_flash_attn_mesh.py and test_v4_mesh.py.

A cases function takes the device mesh and returns {name: callable}; a case raises on failure.
Every rank runs every case; a case passes when it passed on every rank, otherwise the first
failure's traceback is kept. Starting a mesh's ranks (a process each, importing torch) is most of
a small mesh's time, so one process group per mesh shape runs every suite that uses that shape,
the first time a test asks for it, and keeps the results for the session.
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


# Each suite of mesh cases: its module, the function that returns its cases, the axis name of a
# one-axis mesh (two-axis meshes are named ("dp", "cp")) and the meshes it runs on.
SUITES = {
    "distributed": ("distributed_cases", "cp_cases", ("cp",), ("2", "3", "4", "2x2", "2x4")),
    "dsa": ("dsa_mesh_cases", "dsa_cases", ("cp",), ("2", "3", "4", "2x2", "2x4")),
    "flash_attn": ("flash_attn_mesh_cases", "mesh_cases", ("x",), ("2", "3", "4", "2x2", "2x4")),
    "v4": ("v4_mesh_cases", "v4_cases", ("cp",), ("2", "3", "4", "2x2")),
    "fuzz": ("fuzz_mesh_cases", "fuzz_cases", ("x",), ("2", "3", "2x2")),
}
SHAPES = {"2": (2,), "3": (3,), "4": (4,), "2x2": (2, 2), "2x4": (2, 4)}
# The shapes `pytest --grid=sample` keeps: an odd size and two axes.
SAMPLE_SHAPES = ("3", "2x2")
_RESULTS: dict[str, dict[str, dict[str, str]]] = {}


def _run_suite(rank, world, mesh, module, function):
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
    return results


def worker(rank, world, port, shape, suites, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # A rank left waiting in a collective (another rank raised before it) fails the case in
    # minutes instead of hanging the suite.
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    try:
        results = {}
        for suite in suites:
            module, function, one_axis_names, _ = SUITES[suite]
            names = one_axis_names if len(shape) == 1 else ("dp", "cp")
            mesh = opmesh.init_device_mesh("cpu", shape, mesh_dim_names=names)
            results[suite] = _run_suite(rank, world, mesh, module, function)
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            merged = {suite: {} for suite in suites}
            for per_rank in gathered:
                for suite, statuses in per_rank.items():
                    for name, status in statuses.items():
                        if merged[suite].get(name, "ok") == "ok":
                            merged[suite][name] = status
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


def _run_shape(out_dir, shape, suites):
    """Spawns one process per rank of a mesh `shape`, runs every suite's cases there and returns
    {suite: {case: "ok" or the failure}}."""
    world = math.prod(shape)
    here = os.path.dirname(os.path.abspath(__file__))
    # Spawned ranks import the cases modules from this folder.
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
                    args=(world, _free_port(), shape, suites, str(out_dir)),
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


def mesh_results(suite, request, tmp_path_factory):
    """{case: "ok" or the failure} of `suite` on the mesh `request.param` (a key of SHAPES), for
    a test module whose SUITE is `suite`. The first call for a mesh runs, in one process group,
    every suite that uses it and has tests in this session."""
    mesh = request.param
    if mesh not in _RESULTS:
        wanted = {getattr(item.module, "SUITE", None) for item in request.session.items}
        suites = [name for name, spec in SUITES.items() if mesh in spec[3] and name in wanted]
        out = tmp_path_factory.mktemp(f"mesh{mesh}")
        _RESULTS[mesh] = _run_shape(out, SHAPES[mesh], suites)
    return _RESULTS[mesh][suite]
