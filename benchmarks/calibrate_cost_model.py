"""Fits the planner's cost model (csrc/core/attention/cost_model.h) to this CPU's kernel.

Runs flash_attn on one thread with a one-worker plan over shapes that vary each term of the model
independently (query rows per tile, key tiles, head dims, masked tiles), records the kernel's
busy time, and solves the least-squares fit of

    time = task_ns * tasks + row_ns * rows * (D + Dv) + tile_ns * tiles
           + mac_ns * padded_rows * 64 * (D + Dv) * tiles + masked_row_ns * rows * masked_tiles

over all of them. The fitted constants are printed and written to results/cost_model.md; copy
them into cost_model.cpp. (The combine constant is not fitted here; see cost_model.cpp.)

    python benchmarks/calibrate_cost_model.py [--dtype bf16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

import opmesh  # noqa: E402
from opmesh import _C  # noqa: E402
from opmesh._plan_view import plan_pieces  # noqa: E402

TERMS = ["task_ns", "row_ns", "tile_ns", "mac_ns", "masked_row_ns"]


def features(pieces, dims):
    f = np.zeros(len(TERMS))
    for p in pieces:
        tiles = p["k_to"] - p["k_from"]
        padded = (p["rows"] + 5) // 6 * 6
        f += [1, p["rows"] * dims, tiles, padded * 64 * dims * tiles, p["rows"] * p["masked_tiles"]]
    return f


def busy_ns(q, k, v, md, mask_mode, repeats):
    best = float("inf")
    for _ in range(repeats):
        opmesh.flash_attn(q, k, v, metadata=md, mask_mode=mask_mode)
        best = min(best, _C._last_worker_times()[0])
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.set_num_threads(1)
    _C._set_worker_timing(True)
    # One head configuration (the benchmarks': 32 query heads on 8 key heads, D = 128), since a
    # plan only compares units of the same call; query rows, key tiles and masking vary.
    shapes = []  # (s1, s2, nq, nkv, d, mask_mode)
    for s1 in (1, 16, 64, 256, 1024):
        for s2 in (64, 512, 2048, 4096):
            for mode in (0, 3):
                if mode == 0 or s1 <= s2:
                    shapes.append((s1, s2, args.heads_q, args.heads_kv, args.head_dim, mode))
    xs, ys, rows = [], [], []
    gen = torch.Generator().manual_seed(0)
    for s1, s2, nq, nkv, d, mode in shapes:
        q = torch.randn(1, s1, nq, d, generator=gen).to(dtype)
        k = torch.randn(1, s2, nkv, d, generator=gen).to(dtype)
        v = torch.randn(1, s2, nkv, d, generator=gen).to(dtype)
        md = opmesh.flash_attn_metadata(
            nq,
            nkv,
            d,
            batch_size=1,
            max_seqlen_q=s1,
            max_seqlen_kv=s2,
            mask_mode=mode,
            num_workers=1,
        )
        pieces = plan_pieces(md, [s1], [s2])[0]
        xs.append(features(pieces, 2 * d))
        ys.append(busy_ns(q, k, v, md, mode, args.repeats))
        rows.append((s1, s2, nq, nkv, d, mode))
    x, y = np.array(xs), np.array(ys)
    # Weighted by 1/y so that small shapes count as much as large ones (relative error).
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    coef = np.maximum(coef, 0.0)
    pred = x @ coef
    rel = np.abs(pred - y) / y
    table = [
        {
            "s1": r[0],
            "s2": r[1],
            "nq/nkv": f"{r[2]}/{r[3]}",
            "D": r[4],
            "mask": r[5],
            "measured us": f"{t / 1e3:.1f}",
            "model us": f"{p / 1e3:.1f}",
            "error": f"{e:.1%}",
        }
        for r, t, p, e in zip(rows, y, pred, rel, strict=True)
    ]
    fitted = ", ".join(f"{name}={value:.4g}" for name, value in zip(TERMS, coef, strict=True))
    print(fitted)
    print(f"relative error: median {np.median(rel):.1%}, max {rel.max():.1%}")
    write_results(
        "cost_model",
        table,
        list(table[0]),
        notes=[
            f"Fitted ({args.dtype}, one thread): {fitted}",
            f"Relative error over {len(rows)} shapes: median {np.median(rel):.1%}, "
            f"max {rel.max():.1%}.",
            "",
            "Command: `.venv/bin/python benchmarks/calibrate_cost_model.py`",
        ],
    )


if __name__ == "__main__":
    main()
