"""flash_attn on real process groups: data, head and context parallel (all-gather and ring),
forward and gradients, on meshes (2,), (3,), (4,), and (2, 2) and (2, 4) named ("dp", "cp")
(sizes that do not divide them included); every case compares with the single-device call
(flash_attn_mesh_cases.py)."""

import pytest
from flash_attn_mesh_cases import CASE_NAMES, RAW_CASE_NAMES, TWO_AXIS_CASE_NAMES
from mesh_runner import SUITES, mesh_results

SUITE = "flash_attn"


@pytest.fixture(scope="module", params=SUITES[SUITE][3])
def mesh_and_results(request, tmp_path_factory):
    return request.param, mesh_results(SUITE, request, tmp_path_factory)


@pytest.mark.parametrize("case", CASE_NAMES + TWO_AXIS_CASE_NAMES + RAW_CASE_NAMES)
def test_flash_attn_case_on_mesh(mesh_and_results, case):
    mesh, results = mesh_and_results
    if case not in RAW_CASE_NAMES and (case in TWO_AXIS_CASE_NAMES) != ("x" in mesh):
        pytest.skip("a two-axis case" if case in TWO_AXIS_CASE_NAMES else "a one-axis case")
    status = results.get(case, "not run")
    assert status == "ok", f"mesh {mesh}, case {case}:\n{status}"
