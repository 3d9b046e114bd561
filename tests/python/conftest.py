import os
import re
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


def assert_names_argument(error: BaseException, argument: str) -> None:
    """The message must start with the argument's name (followed by ':' or ','), so a message
    that only mentions it in passing, or blames another argument first, fails."""
    message = str(error)
    assert re.match(rf"{re.escape(argument)}[:,]", message), (
        f"message does not start with {argument!r}: {message!r}"
    )
