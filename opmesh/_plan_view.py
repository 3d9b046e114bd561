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
    height = max(3.0, 0.18 * len(workers) + 1.5)
    fig, ax = plt.subplots(figsize=(11, height))
    pieces_of_tile = Counter((p["b"], p["h"], p["t"]) for pieces in workers for p in pieces)
    for w, pieces in enumerate(workers):
        start = 0.0
        for p in pieces:
            split = pieces_of_tile[(p["b"], p["h"], p["t"])] > 1
            ax.barh(
                w,
                p["cost"] / 1e3,
                left=start / 1e3,
                height=0.8,
                color=colors(p["b"] % 20),
                edgecolor="black" if split else "none",
                linewidth=0.3,
                hatch="///" if split else None,
            )
            start += p["cost"]
    ax.axvline(summary["lower_bound"] / 1e3, color="red", linestyle="--", label="lower bound")
    ax.set_xlabel("modelled time (µs)")
    ax.set_ylabel("logical worker")
    ax.invert_yaxis()
    ratio = summary["makespan"] / summary["lower_bound"] if summary["lower_bound"] else 1.0
    ax.set_title(
        f"{len(q_lens)} sequences on {summary['num_workers']} workers: makespan / lower "
        f"bound = {ratio:.3f}, {summary['num_splits']} split tiles, "
        f"{summary['num_tasks']} tasks (colour: sequence; hatched: split)"
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args):
    q_lens = args.seqlens_q
    k_lens = args.seqlens_kv or q_lens
    if len(k_lens) != len(q_lens):
        raise SystemExit("--seqlens-kv: expected one length per --seqlens-q entry")
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
