"""Bounded fuzzing: seeded random mutations of valid calls to every op (sizes 0, 1, odd and huge
through stride-0 expand; wrong dtypes, ranks, devices and layouts; mask modes and windows out of
range; length arrays negative, decreasing, too long or float; NaN and infinite values;
non-contiguous views; forged plans; quantized caches). Each call must give a correct result
(checked against the float64 references) or raise an exception whose message starts with an
argument's name, never crash: the cases run in a child process, so a crash fails the test and
names the case. For the ops whose generators make only valid calls unless they mutate one, a
refusal of an unmutated call fails too. Every kernel call of an accepted case (the backward's
too, where gradients are checked) runs again on fake tensors, with sizes as symbols or as ints:
the shape function must accept it and give the kernel's shapes, dtypes and strides. A quarter of
the accepted unmutated calls run again on 1, 2 and 3 threads and must give the same bits, and a
few unmutated calls per op run compiled (fullgraph, static and dynamic sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASES_PER_OP = 150
HERE = os.path.dirname(os.path.abspath(__file__))


OPS = [
    "flash_attn",
    "flash_attn_metadata",
    "indexer",
    "kv_cache_write_",
    "describe_metadata",
    "compressor",
    "sparse_flash_mla",
    "sparse_flash_attention",
    "lightning_indexer",
    "dense_lightning_indexer_grad_kl_loss",
    "sparse_lightning_indexer_grad_kl_loss",
]


@pytest.mark.parametrize("op", OPS)
def test_fuzzed_calls_end_in_a_correct_result_or_a_named_error(op):
    seed = OPS.index(op) + 1000
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "fuzz_child.py"), op, str(seed), str(CASES_PER_OP)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE,
    )
    lines = done.stdout.splitlines()
    last = next((x for x in reversed(lines) if x.startswith("CASE")), "before the first case")
    assert done.returncode == 0, (
        f"the child died (exit {done.returncode}) at {last} (seed {seed}):\n{done.stderr[-3000:]}"
    )
    result = json.loads(next(x for x in lines if x.startswith("RESULT"))[len("RESULT ") :])
    assert not result["bad"], "\n".join(result["bad"][:10])
    # The generator must reach both outcomes, or it tests nothing.
    assert result["ok"] > 0 and result["refused"] > 0, result


COMPILED_CASES_PER_OP = 4


@pytest.mark.parametrize("op", [op for op in OPS if op != "describe_metadata"])
def test_fuzzed_valid_calls_compile_to_the_checked_result(op):
    """The unmutated calls among the first cases, through torch.compile(fullgraph=True) with
    static and dynamic sizes in turn: each compiles and gives the checked result."""
    seed = OPS.index(op) + 2000
    command = [sys.executable, os.path.join(HERE, "fuzz_child.py"), op, str(seed)]
    done = subprocess.run(
        command + [str(COMPILED_CASES_PER_OP), "--compiled"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, f"the child died (exit {done.returncode}):\n{done.stderr[-3000:]}"
    result = json.loads(next(x for x in lines if x.startswith("RESULT"))[len("RESULT ") :])
    assert not result["bad"], "\n".join(result["bad"][:10])
    assert result["ok"] > 0, result
