"""The DSA operators on real process groups: a whole layer (indexers, sparse attention, KL
losses, forward and backward) on gloo meshes equals one device (dsa_mesh_cases.py)."""

import pytest
from dsa_mesh_cases import CASE_NAMES, TWO_AXIS_CASES
from mesh_runner import run_cases

MESHES = {
    "2": ((2,), ("cp",)),
    "3": ((3,), ("cp",)),
    "4": ((4,), ("cp",)),
    "2x2": ((2, 2), ("dp", "cp")),
    "2x4": ((2, 4), ("dp", "cp")),
}


@pytest.fixture(scope="module", params=list(MESHES))
def mesh_results(request, tmp_path_factory):
    shape, names = MESHES[request.param]
    out = tmp_path_factory.mktemp(f"dsa_mesh{request.param}")
    return request.param, run_cases(out, shape, names, "dsa_mesh_cases", "dsa_cases")


@pytest.mark.parametrize("case", CASE_NAMES + TWO_AXIS_CASES)
def test_dsa_layer_on_mesh(mesh_results, case):
    mesh, results = mesh_results
    if case in TWO_AXIS_CASES and "x" not in mesh:
        pytest.skip("needs a two-axis mesh")
    status = results.get(case, "not run")
    assert status == "ok", f"mesh {mesh}, case {case}:\n{status}"
