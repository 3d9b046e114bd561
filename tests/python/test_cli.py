"""The command line: --version, help for every option, one-line errors for bad arguments, and the
plan picture's layout (every run visible, none hidden, a legend entry per sequence)."""

import subprocess
import sys

import pytest

import opmesh
from opmesh import _plan_view


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "opmesh", *args], capture_output=True, text=True, timeout=120
    )


def test_version():
    result = cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("python -m opmesh "), result


@pytest.mark.parametrize("command", ["demo", "plan"])
def test_every_option_has_help(command):
    from opmesh.__main__ import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    import argparse

    captured = []
    original = argparse.ArgumentParser.add_argument

    def record(self, *args, **kwargs):
        captured.append((args, kwargs.get("help")))
        return original(self, *args, **kwargs)

    argparse.ArgumentParser.add_argument = record
    try:
        with pytest.raises(SystemExit):
            main([command, "--help"])
    finally:
        argparse.ArgumentParser.add_argument = original
    missing = [args for args, text in captured if not text and args != ("-h", "--help")]
    assert not missing, f"options without help: {missing}"


@pytest.mark.parametrize(
    "args,prefix",
    [
        (["plan", "--seqlens-q", "10", "-5"], "--seqlens-q: lengths must be >= 0"),
        (["plan", "--seqlens-q", "10", "--seqlens-kv", "3", "4"], "--seqlens-kv: expected one"),
        (["plan", "--seqlens-q", "10", "--num-workers", "0"], "--num-workers: must be >= 1"),
        (["plan", "--seqlens-q", "10", "--heads-q", "3"], "--heads-kv: must divide"),
    ],
)
def test_bad_arguments_give_one_line(args, prefix):
    result = cli(*args)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"python -m opmesh plan: error: {prefix}"), lines[0]


def test_picture_runs_are_visible_and_never_overlap():
    q_lens = [4000, 30, 2, 900, 17, 1, 2500, 64, 300, 8000]
    metadata = _plan_view.varlen_metadata(
        q_lens, q_lens, heads_q=32, heads_kv=8, head_dim=128, mask_mode=3, num_workers=12
    )
    workers = _plan_view.plan_pieces(metadata, q_lens, q_lens)
    summary = opmesh.describe_metadata(metadata)
    min_width = 0.006 * summary["makespan"]
    bars = _plan_view.layout_runs(workers, min_width)
    assert {b for _, b, _, _, _ in bars} == set(range(len(q_lens))), "a sequence is not drawn"
    for w in range(len(workers)):
        mine = [(left, width) for worker, _, _, left, width in bars if worker == w]
        for (left, width), (next_left, _) in zip(mine, mine[1:], strict=False):
            assert width >= min_width and next_left >= left + width - 1e-6
    # The work drawn is the work planned (widening adds only the minimum widths).
    drawn = sum(width for *_, width in bars)
    assert drawn >= sum(summary["worker_cost"]) - 1e-3


def test_picture_is_written(tmp_path):
    pytest.importorskip("matplotlib", reason="drawing needs the optional matplotlib")
    path = tmp_path / "plan.png"
    result = cli("plan", "--seqlens-q", "700", "3", "90", "--num-workers", "4", "--png", str(path))
    assert result.returncode == 0, result.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mindspore_demo_without_mindspore_says_how_to_get_it():
    pytest.importorskip("torch")
    try:
        import mindspore  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("MindSpore is installed here: tests/mindspore runs this demo")
    result = cli("demo", "--framework", "mindspore")
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "python -m opmesh demo: error: --framework: mindspore is not installed"
    ), lines[0]
