import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import opmesh  # noqa: E402


@pytest.fixture(params=opmesh.simd_levels())
def simd_level(request, monkeypatch):
    """Runs a test once per SIMD path this machine supports, checking the cap took effect."""
    monkeypatch.setenv("OPMESH_SIMD_MAX", request.param)
    assert opmesh.active_simd_level() == request.param
    return request.param
