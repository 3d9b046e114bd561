"""DeepSeek-V4's operators on real process groups: sparse_flash_mla of each layer kind (SWA,
HCA, CSA) data and context parallel, BSND and TND, head-tail order in both orders, forward and
gradients, and the compressor data parallel, on meshes (2,), (3,), (4,) and (2, 2) (sizes that
do not divide them included); every case compares with one device (v4_mesh_cases.py)."""

import pytest
from mesh_runner import SUITES, mesh_results
from v4_mesh_cases import CASE_NAMES

SUITE = "v4"


@pytest.fixture(scope="module", params=SUITES[SUITE][3])
def mesh_and_results(request, tmp_path_factory):
    return request.param, mesh_results(SUITE, request, tmp_path_factory)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_v4_case_on_mesh(mesh_and_results, case):
    mesh, results = mesh_and_results
    status = results.get(case, "not run")
    assert status == "ok", f"mesh {mesh}, case {case}:\n{status}"
