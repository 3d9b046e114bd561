"""docs/mindspore.md's Python snippets run, in order, in one fresh interpreter (the page is
left out of tests/python/test_docs.py, whose environment has no MindSpore)."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)


def test_mindspore_page_snippets_run():
    text = (ROOT / "docs" / "mindspore.md").read_text()
    blocks = [textwrap.dedent(m.group("body")) for m in FENCE.finditer(text)]
    assert len(blocks) >= 3
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(blocks)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
