"""Decode's product kernels against the instruction they multiply with, on one core.

``key_scores`` (a few query rows against 64 bf16 key rows read where they lie) and
``value_rows`` (P.V on 64 bf16 value rows in place) of every kernel set this machine runs, for 1,
2, 4 and 8 rows (a decode's query heads per key head), D = 128, with the rows in L1 (one tile
read again and again) or in L2 (16 tiles in turn). Beside each: the peak of the set's multiply
instruction measured in the same run by a loop of independent accumulators (VDPBF16PS on zmm
for a bf16-pair set, FMA on zmm or ymm for a float32 set), and the kernel's share of it. The
measuring is C++ (``benchmarks/kernel_rates.cpp``, built with the core's tests into
``build/core-tests`` by ``make kernel-rates``); this script builds it and writes the table.

    python benchmarks/bench_kernel_rates.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "core-tests"
PROGRAM = BUILD / "opmesh_kernel_rates"


def build():
    # make's target: the same configuration (compiler, ccache base) as the core's tests' build.
    subprocess.run(["make", "-C", str(ROOT), "kernel-rates"], check=True)


def main():
    build()
    out = subprocess.run([str(PROGRAM)], check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        kernel_set, kernel, n, lie, ns, gflops, peak = line.split("\t")
        share = f"{float(gflops) / float(peak):.0%}" if float(peak) > 0 else "-"
        rows.append(
            {
                "set": kernel_set,
                "kernel": kernel,
                "rows": n,
                "rows lie in": lie,
                "ns per 64 keys": ns,
                "GFLOP/s": gflops,
                "peak GFLOP/s": peak if float(peak) > 0 else "-",
                "% of peak": share,
            }
        )
        print(rows[-1], flush=True)
    write_results(
        "kernel_rates",
        rows,
        list(rows[0]),
        notes=[
            "One core, D = 128, 64 keys a call. GFLOP/s: 2 x rows x 64 x D over the time of a "
            "call. Peak: the set's multiply instruction in a loop of 12 independent "
            "accumulators, in this run (VDPBF16PS zmm: 64 flops; FMA zmm: 32; FMA ymm: 16); "
            "'-' for a set on AMX tiles. L1: the same 64 rows every call; L2: 16 tiles in turn "
            "(256 KiB of keys and 256 KiB of values).",
            "`.venv/bin/python benchmarks/bench_kernel_rates.py`",
        ],
    )


if __name__ == "__main__":
    main()
