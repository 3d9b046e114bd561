"""The training example trains: its KL loss falls and the indexer's top-k recall of the main
attention's mass rises (a short run, as `make demo` does)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_indexer_warmup_learns():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_indexer_warmup.py"), "--steps", "40"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = result.stdout
    before = float(re.search(r"recall before training: ([0-9.]+)", out).group(1))
    recalls = [float(r) for r in re.findall(r"top-16 recall ([0-9.]+)", out)]
    first, last = map(float, re.search(r"KL per token: ([0-9.]+) -> ([0-9.]+)", out).groups())
    assert last < 0.7 * first, out
    assert recalls[-1] > before + 0.2, out
