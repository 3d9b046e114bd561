"""Seeded random flash_attn calls (BSND, BNSD and TND), DSA layers and DeepSeek-V4 attention
layers on meshes (2,), (3,) and (2, 2) named ("dp", "cp"): random sizes, layouts, masks, schemes
and placements per axis; each call gives the single-device results, gradients included, or is
refused by an argument's name on every rank (fuzz_mesh_cases.py)."""

import pytest
from fuzz_mesh_cases import CASE_NAMES
from mesh_runner import SUITES, mesh_results

SUITE = "fuzz"


@pytest.fixture(scope="module", params=SUITES[SUITE][3])
def mesh_and_results(request, tmp_path_factory):
    return request.param, mesh_results(SUITE, request, tmp_path_factory)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_fuzzed_mesh_call(mesh_and_results, case):
    mesh, results = mesh_and_results
    status = results.get(case, "not run")
    assert status == "ok", f"mesh {mesh}, case {case}:\n{status}"
