import os
import re
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# The bf16 kernel calibration file of this session's processes (spawned mesh ranks included):
# its own folder, not the user's.
os.environ.setdefault("OPMESH_CACHE_DIR", tempfile.mkdtemp(prefix="opmesh-test-cache-"))

import opmesh  # noqa: E402


def _kernel_paths():
    """Every SIMD level this machine supports; at avx512_bf16 both kernel sets bf16 inputs can
    take there (bf16 pairs and float32 FMA), since the measured choice would test only one; and
    the amx_bf16 kernels, on AMX tiles where the CPU has them and on the portable tile emulation
    wherever AVX-512 BF16 is present."""
    paths = []
    for level in opmesh.simd_levels():
        if level == "avx512_bf16":
            paths += ["avx512_bf16/pairs", "avx512_bf16/fp32", "amx_bf16/emulated"]
        elif level == "amx_bf16":
            paths.append("amx_bf16/tiles")
        else:
            paths.append(level)
    return paths


@pytest.fixture(params=_kernel_paths())
def simd_level(request, monkeypatch):
    """Runs a test once per kernel path this machine supports, checking the cap took effect."""
    level, _, variant = request.param.partition("/")
    monkeypatch.setenv("OPMESH_SIMD_MAX", level)
    monkeypatch.setenv("OPMESH_AMX_TILES", "emulate" if variant == "emulated" else "auto")
    bf16 = {"emulated": "pairs", "tiles": "pairs"}.get(variant, variant)
    monkeypatch.setenv("OPMESH_BF16_KERNELS", bf16 or "auto")
    assert opmesh.active_simd_level() == level
    if bf16:
        choice = opmesh.bf16_kernels()
        assert all(c["pairs"] == (bf16 == "pairs") for c in choice.values()), choice
        if level == "amx_bf16":
            want = f"amx_bf16/{variant}"
            assert all(c["kernel_set"] == want for c in choice.values()), choice
    return request.param


def assert_names_argument(error: BaseException, argument: str) -> None:
    """The message must start with the argument's name (followed by ':' or ','), so a message
    that only mentions it in passing, or blames another argument first, fails."""
    message = str(error)
    assert re.match(rf"{re.escape(argument)}[:,]", message), (
        f"message does not start with {argument!r}: {message!r}"
    )


def assert_raises_named(exc, argument: str, fn):
    """fn() raises `exc` whose message starts with `argument`; returns the exception."""
    with pytest.raises(exc) as info:
        fn()
    assert_names_argument(info.value, argument)
    return info.value


def pytest_addoption(parser):
    parser.addoption(
        "--grid",
        choices=("full", "sample"),
        default="full",
        help="full: every case of every parametrized test; sample: every test function with the "
        "first and last cases of its grid, and the mesh suites on the meshes of "
        "mesh_runner.SAMPLE_SHAPES (the second torch release's run: its kernels are the same)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--grid") != "sample":
        return
    from mesh_runner import SAMPLE_SHAPES

    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((item.path, item.originalname), []).append(item)
    kept = set()
    for group in groups.values():
        callspec = getattr(group[0], "callspec", None)
        if callspec is not None and "mesh_and_results" in callspec.params:
            # A mesh's suites run once per shape for all its cases: the sample is by shape.
            kept.update(i for i in group if i.callspec.params["mesh_and_results"] in SAMPLE_SHAPES)
        else:
            kept.update((group[0], group[-1]))
    config.hook.pytest_deselected(items=[i for i in items if i not in kept])
    items[:] = [i for i in items if i in kept]
