#!/usr/bin/env bash
# Packaging check: in a fresh virtual environment that has only torch, `pip wheel .` from a copy
# of the tracked sources builds in pip's isolated build environment (so every build requirement
# must be declared), and installing that wheel brings every runtime dependency (what
# `pip install .` does, with one build instead of two); the installed package imports, reports
# its version, ships py.typed and runs an operator from outside the source tree.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
(cd "$root" && git ls-files -z | xargs -0 cp --parents -t "$work/src")
python3 -m venv "$work/venv"
pip="$work/venv/bin/pip"
"$pip" install -q --disable-pip-version-check torch==2.13.0
# The build folder is build/<wheel tag> in the copy, as in the tree: with the copy as ccache's
# base folder, the objects compiled for the tree (against the same torch) are reused.
export CCACHE_BASEDIR="$work/src"
echo "pip wheel . (isolated build, only torch installed beforehand), then pip install the wheel"
"$pip" wheel -q --disable-pip-version-check --no-deps -w "$work/dist" "$work/src"
"$pip" install -q --disable-pip-version-check "$work"/dist/opmesh-*.whl
cd "$work"
"$work/venv/bin/python" - <<'PY'
import importlib.metadata as md
import pathlib

import torch

import opmesh

assert opmesh.__version__ == md.version("opmesh"), (opmesh.__version__, md.version("opmesh"))
package = pathlib.Path(opmesh.__file__).parent
assert (package / "py.typed").exists(), "py.typed is missing"
assert md.metadata("opmesh")["License-Expression"] == "MIT"
q = torch.randn(1, 16, 4, 32)
k = torch.randn(1, 16, 2, 32)
out, _ = opmesh.flash_attn(q, k, k, mask_mode=3)
ref = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), is_causal=True, enable_gqa=True
).transpose(1, 2)
torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
print(f"installed opmesh {opmesh.__version__} works; requires {md.requires('opmesh')}")
PY
echo "packaging check passed"
