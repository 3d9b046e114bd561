"""DeepSeek-V4's operators on real process groups: sparse_flash_mla of each layer kind (SWA,
HCA, CSA) data and context parallel, BSND and TND, head-tail order in both orders, forward and
gradients, and the compressor data parallel, on meshes (2,), (3,), (4,) and (2, 2) (sizes that
do not divide them included); every case compares with one device (v4_mesh_cases.py)."""

import pytest
from mesh_runner import run_cases
from v4_mesh_cases import CASE_NAMES

MESHES = {"2": ((2,), ("cp",)), "3": ((3,), ("cp",)), "4": ((4,), ("cp",)),
          "2x2": ((2, 2), ("dp", "cp"))}  # fmt: skip


@pytest.fixture(scope="module", params=list(MESHES))
def mesh_results(request, tmp_path_factory):
    shape, names = MESHES[request.param]
    out = tmp_path_factory.mktemp(f"v4_mesh{request.param}")
    return request.param, run_cases(out, shape, names, "v4_mesh_cases", "v4_cases")


@pytest.mark.parametrize("case", CASE_NAMES)
def test_v4_case_on_mesh(mesh_results, case):
    mesh, results = mesh_results
    status = results.get(case, "not run")
    assert status == "ok", f"mesh {mesh}, case {case}:\n{status}"
