"""flash_attn on real process groups: data, head and context parallel (all-gather and ring),
forward and gradients, on meshes (2,), (3,), (4,) and (2, 2) named ("dp", "cp") (sizes that do
not divide them included); every case compares with the single-device call
(flash_attn_mesh_cases.py)."""

import json
import os
import socket

import pytest
import torch.multiprocessing as mp
from flash_attn_mesh_cases import CASE_NAMES, TWO_AXIS_CASE_NAMES, worker

MESHES = {"2": (2,), "3": (3,), "4": (4,), "2x2": (2, 2)}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=list(MESHES))
def mesh_results(request, tmp_path_factory):
    shape = MESHES[request.param]
    world = 1
    for n in shape:
        world *= n
    names = ("dp", "cp") if len(shape) == 2 else ("x",)
    out = tmp_path_factory.mktemp(f"attn_mesh{request.param}")
    here = os.path.dirname(os.path.abspath(__file__))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, saved]))
    try:
        mp.start_processes(
            worker,
            args=(world, _free_port(), shape, names, str(out)),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    with open(out / "results.json") as f:
        return request.param, json.load(f)


@pytest.mark.parametrize("case", CASE_NAMES + TWO_AXIS_CASE_NAMES)
def test_flash_attn_case_on_mesh(mesh_results, case):
    mesh, results = mesh_results
    if (case in TWO_AXIS_CASE_NAMES) != ("x" in mesh):
        pytest.skip("a two-axis case" if case in TWO_AXIS_CASE_NAMES else "a one-axis case")
    status = results.get(case, "not run")
    assert status == "ok", f"mesh {mesh}, case {case}:\n{status}"
