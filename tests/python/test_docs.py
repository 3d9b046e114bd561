"""Every Python snippet in README.md and docs/ runs. A file's ```python blocks run in order in one
fresh interpreter (a block may use what an earlier one defined), after the file's hidden
``<!-- snippet-setup ... -->`` code if it has one. A block that builds a device mesh
(``init_device_mesh``) is self-contained and runs under a multi-process gloo launcher with one
process per mesh position. Signatures that are not meant to run are fenced as ```text."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)
SETUP = re.compile(r"<!--\s*snippet-setup\s*\n(?P<body>.*?)-->", re.S)
MESH = re.compile(r'init_device_mesh\(\s*"cpu",\s*\((?P<shape>[\d,\s]+)\)')


def snippets(path: Path):
    text = path.read_text()
    setup = "\n".join(textwrap.dedent(m.group("body")) for m in SETUP.finditer(text))
    local, mesh = [], []
    for m in FENCE.finditer(text):
        body = textwrap.dedent(m.group("body"))
        (mesh if MESH.search(body) else local).append(body)
    return setup, local, mesh


# A page whose snippets need another framework says so (<!-- snippets-run-with: mindspore -->);
# its own suite runs them (tests/mindspore/test_docs_mindspore.py).
OTHER_FRAMEWORK = re.compile(r"<!--\s*snippets-run-with:\s*(\w+)\s*-->")
FILES = {
    str(p.relative_to(ROOT)): p
    for p in DOCS
    if any(snippets(p)[1:]) and not OTHER_FRAMEWORK.search(p.read_text())
}


def test_the_docs_have_snippets_to_run():
    counts = {name: sum(map(len, snippets(p)[1:])) for name, p in FILES.items()}
    assert "README.md" in counts and sum(counts.values()) >= 6, counts


def _run(code: str, env=None):
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize("name", sorted(FILES))
def test_snippets_run(name):
    setup, local, _ = snippets(FILES[name])
    if not local:
        pytest.skip("only mesh snippets")
    proc = _run("\n\n".join([setup, *local]))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"


# Every rank waits for the others and closes the process group before exiting, as a script under
# torchrun should: a rank that exits while its gloo peers still talk to it can abort at shutdown.
# After the snippet and the process group's teardown, the process leaves without the
# interpreter's finalisation: a std::terminate from a library thread destroyed at exit was seen
# once under heavy load, after every assertion of the snippet had passed.
TEARDOWN = """
import os as _os, sys as _sys
import torch.distributed as _dist
if _dist.is_initialized():
    _dist.barrier()
    _dist.destroy_process_group()
_sys.stdout.flush()
_sys.stderr.flush()
_os._exit(0)
"""

MESH_CASES = [(name, i) for name, p in sorted(FILES.items()) for i in range(len(snippets(p)[2]))]


@pytest.mark.parametrize(("name", "index"), MESH_CASES)
def test_mesh_snippets_run_on_a_multi_process_mesh(name, index):
    setup, _, mesh = snippets(FILES[name])
    code = "\n\n".join([setup, mesh[index], TEARDOWN])
    shape = [int(x) for x in MESH.search(code).group("shape").split(",") if x.strip()]
    world = math.prod(shape)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(_run(code, env))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            proc.kill()
    failed = [
        (r, out) for r, (p, out) in enumerate(zip(procs, outputs, strict=True)) if p.returncode
    ]
    assert not failed, f"{name} snippet {index}, rank {failed[0][0]}:\n{failed[0][1][-4000:]}"
