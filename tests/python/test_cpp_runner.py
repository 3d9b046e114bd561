"""A C++ program with no Python runs an AOTInductor package that calls opmesh's operators:
examples/cpp_decoder_step exports a decoder step (kv_cache_write_ then flash_attn on a paged
cache), builds the runner against libtorch and libopmesh_ops through CMake's find_package, and
runs it with an empty environment. The runner checks the output and the in-place cache append
against Python's, and calls flash_attn through the typed C++ entry point."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.utils

import opmesh

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpp_decoder_step"


def run(args, **kwargs):
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, **kwargs)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake (make system-deps)")
def test_cpp_program_runs_the_aoti_package_without_python(tmp_path):
    package = tmp_path / "package"
    run([sys.executable, str(EXAMPLE / "export_decoder_step.py"), str(package)])
    prefix = f"{torch.utils.cmake_prefix_path};{opmesh.cmake_prefix_path}"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    build = tmp_path / "build"
    run(["cmake", *generator, "-S", str(EXAMPLE), "-B", str(build),
         f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"])  # fmt: skip
    run(["cmake", "--build", str(build)])
    binary = build / "run_decoder_step"
    # No Python on the library path, no PYTHONPATH: only what the binary's run paths give.
    done = run([str(binary), str(package)], env={"PATH": os.defpath})
    assert "OK" in done.stdout.splitlines(), done.stdout
    libraries = run(["ldd", str(binary)]).stdout
    assert "libopmesh_ops.so" in libraries and "libpython" not in libraries, libraries
