"""`python -m opmesh plan`: plans a variable-length batch and shows how the work is spread.

Prints the plan summary and, with --png, draws each logical worker's timeline: one bar per piece
of work in the order the worker runs them, coloured by sequence, hatched where a piece is part of
a query tile split along the key axis, against the lower bound max(total / workers, largest
indivisible task).
"""

from __future__ import annotations

from collections import Counter

import torch

import opmesh

from . import _C
from .ops import plan_bytes


def plan_pieces(metadata: torch.Tensor, q_lens, k_lens):
    """Each worker's pieces as dicts with the sequence, key head, query tile, key tiles, rows and
    modelled cost (ns), for a plan made for per-sequence lengths q_lens / k_lens."""
    words = plan_bytes(metadata)
    names = (
        "b",
        "h",
        "t",
        "k_from",
        "k_to",
        "rows",
        "cost",
        "task_cost",
        "combine_cost",
        "masked_tiles",
    )
    raw = _C._plan_pieces(words, list(zip(q_lens, k_lens, strict=True)))
    return [[dict(zip(names, piece, strict=True)) for piece in worker] for worker in raw]


def varlen_metadata(
    q_lens, k_lens, *, heads_q, heads_kv, head_dim, mask_mode, num_workers, deterministic=False
):
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return opmesh.flash_attn_metadata(
        heads_q,
        heads_kv,
        head_dim,
        cu_seqlens_q=cu(q_lens),
        cu_seqlens_kv=cu(k_lens),
        batch_size=len(q_lens),
        max_seqlen_q=max(q_lens, default=0),
        max_seqlen_kv=max(k_lens, default=0),
        mask_mode=mask_mode,
        layout_q="TND",
        layout_kv="TND",
        layout_out="TND",
        num_workers=num_workers,
        deterministic=deterministic,
    )


def draw(metadata, q_lens, k_lens, path):
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "--png: drawing needs matplotlib, an optional dependency: pip install 'opmesh[plot]'"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = opmesh.describe_metadata(metadata)
    workers = plan_pieces(metadata, q_lens, k_lens)
    colors = plt.get_cmap("tab20")
    height = max(3.5, 0.22 * len(workers) + 1.8)
    fig, ax = plt.subplots(figsize=(12, height))
    longest = max((sum(p["cost"] for p in pieces) for pieces in workers), default=0)
    min_width = 0.006 * max(longest, summary["lower_bound"])
    for w, b, split, left, width in layout_runs(workers, min_width):
        ax.barh(
            w,
            width / 1e3,
            left=left / 1e3,
            height=0.8,
            color=colors(b % 20),
            edgecolor="black" if split else "white",
            linewidth=0.5,
            hatch="///" if split else None,
        )
    ax.axvline(summary["lower_bound"] / 1e3, color="red", linestyle="--")
    ax.set_xlabel("modelled time (µs); runs shorter than 0.6% of the axis widened to stay visible")
    # Every worker labelled up to 48 of them; beyond, every n-th, and the axis says so.
    step = 1 if len(workers) <= 48 else -(-len(workers) // 48)
    ax.set_yticks(range(0, len(workers), step))
    ax.set_ylabel("logical worker" + (f" (one label per {step} workers)" if step > 1 else ""))
    ax.set_ylim(len(workers) - 0.5, -0.5)
    ratio = summary["makespan"] / summary["lower_bound"] if summary["lower_bound"] else 1.0
    ax.set_title(
        f"{len(q_lens)} sequences on {summary['num_workers']} workers: makespan / lower "
        f"bound = {ratio:.3f}, {summary['num_splits']} split tiles, {summary['num_tasks']} tasks"
    )
    handles = _legend_handles(plt, colors, q_lens, k_lens)
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title="sequence (q/k tokens)",
        title_fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def layout_runs(workers, min_width):
    """The bars to draw: ``(worker, sequence, split, left, width)`` per run of consecutive
    pieces of one sequence on a worker (split and unsplit pieces apart). Every run is at least
    ``min_width`` wide so that it stays visible; the runs after a widened one move right by as
    much, so no run hides another."""
    pieces_of_tile = Counter((p["b"], p["h"], p["t"]) for pieces in workers for p in pieces)
    bars = []
    for w, pieces in enumerate(workers):
        runs = []  # [sequence, split, start, cost]
        start = 0.0
        for p in pieces:
            split = pieces_of_tile[(p["b"], p["h"], p["t"])] > 1
            if runs and runs[-1][0] == p["b"] and runs[-1][1] == split:
                runs[-1][3] += p["cost"]
            else:
                runs.append([p["b"], split, start, p["cost"]])
            start += p["cost"]
        shown_end = 0.0
        for b, split, left, cost in runs:
            left = max(left, shown_end)
            width = max(cost, min_width)
            shown_end = left + width
            bars.append((w, b, split, left, width))
    return bars


def _legend_handles(plt, colors, q_lens, k_lens, shown=20):
    """The legend, outside the bars: one swatch per sequence (the first `shown`; colours repeat
    every 20 sequences), the split hatching and the lower bound."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(color=colors(b % 20), label=f"{b}: {q}/{k}")
        for b, (q, k) in enumerate(zip(q_lens, k_lens, strict=True))
        if b < shown
    ]
    if len(q_lens) > shown:
        handles.append(
            Patch(color="white", label=f"... {len(q_lens) - shown} more (colour = index mod 20)")
        )
    handles.append(
        Patch(facecolor="white", edgecolor="black", hatch="///", label="split along the keys")
    )
    handles.append(Line2D([0], [0], color="red", linestyle="--", label="lower bound"))
    return handles


def run(args):
    q_lens = args.seqlens_q
    k_lens = args.seqlens_kv or q_lens
    if len(k_lens) != len(q_lens):
        raise ValueError("--seqlens-kv: expected one length per --seqlens-q entry")
    for flag, lens in (("--seqlens-q", q_lens), ("--seqlens-kv", k_lens)):
        if any(n < 0 for n in lens):
            raise ValueError(f"{flag}: lengths must be >= 0, got {min(lens)}")
    if args.num_workers is not None and args.num_workers < 1:
        raise ValueError(f"--num-workers: must be >= 1, got {args.num_workers}")
    md = varlen_metadata(
        q_lens,
        k_lens,
        heads_q=args.heads_q,
        heads_kv=args.heads_kv,
        head_dim=args.head_dim,
        mask_mode=args.mask_mode,
        num_workers=args.num_workers,
        deterministic=args.deterministic,
    )
    s = opmesh.describe_metadata(md)
    print(
        f"sequences {len(q_lens)}, workers {s['num_workers']}, tasks {s['num_tasks']}, "
        f"split query tiles {s['num_splits']}"
    )
    print(
        f"makespan {s['makespan'] / 1e3:.1f} µs, lower bound {s['lower_bound'] / 1e3:.1f} µs, "
        f"ratio {s['makespan'] / max(s['lower_bound'], 1e-9):.4f}"
    )
    costs = s["worker_cost"]
    print(
        f"worker cost min/mean/max: {min(costs) / 1e3:.1f} / "
        f"{sum(costs) / len(costs) / 1e3:.1f} / {max(costs) / 1e3:.1f} µs"
    )
    if args.png:
        draw(md, q_lens, k_lens, args.png)
        print(f"wrote {args.png}")
