"""The DSA operators on real process groups: a whole layer (indexers, sparse attention, KL
losses, forward and backward) on gloo meshes equals one device (dsa_mesh_cases.py)."""

import pytest
from dsa_mesh_cases import CASE_NAMES, TWO_AXIS_CASES
from mesh_runner import SUITES, mesh_results

SUITE = "dsa"


@pytest.fixture(scope="module", params=SUITES[SUITE][3])
def mesh_and_results(request, tmp_path_factory):
    return request.param, mesh_results(SUITE, request, tmp_path_factory)


@pytest.mark.parametrize("case", CASE_NAMES + TWO_AXIS_CASES)
def test_dsa_layer_on_mesh(mesh_and_results, case):
    mesh, results = mesh_and_results
    if case in TWO_AXIS_CASES and "x" not in mesh:
        pytest.skip("needs a two-axis mesh")
    status = results.get(case, "not run")
    assert status == "ok", f"mesh {mesh}, case {case}:\n{status}"
