"""DeepSeek-V4's attention (``sparse_flash_mla``) against the strongest PyTorch composition.

Parts (``--parts``):

- ``layer``: one CSA layer (a 128-token window of the original keys and a top-``--topk`` of the
  keys compressed 4:1) and one HCA layer (the window and every key compressed 128:1 that a row
  has passed), ``--heads`` query heads over one shared key/value head of ``--dim``, sinks, bf16,
  at each ``--seq``: forward, and forward + backward, against the same attention composed in
  PyTorch (each chunk of query rows gathers its keys, then batched matmuls, the sink, softmax),
  eager and compiled, at the chunk size that runs fastest. Time, GFLOP/s (the keys each row
  reads x 4 N1 D), peak extra memory and the ratio to the best composition.
- ``decode``: one query token for each of ``--batch`` sequences of ``--context`` tokens over
  paged caches (an HCA layer: the window and ``context / 128`` compressed entries), against the
  composition on the gathered keys; time, the bytes of key/value rows read per second, and
  GFLOP/s.

- ``compressor``: the compressors of a CSA layer (``coff=2``, 4:1) and an HCA layer (128:1)
  over ``--hidden`` channels into entries of ``--dim``, bf16, forward and forward + backward,
  against transformers' formulation in PyTorch (the two projections as matmuls, the windows
  re-arranged, softmax, weighted sum), eager and compiled. GFLOP/s counts the projections'
  products (2 x 2 coff D x H per token; x 3 with the backward).

    python benchmarks/bench_v4.py [--seq 8192 32768] [--parts layer decode compressor]
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    as_on_this_tier,
    best_on_this_tier,
    peak_extra_bytes,
    tier_compositions,
    tier_matmul_dtype,
    time_call,
    write_results,
)

import opmesh  # noqa: E402

WINDOW = 128


def layer_inputs(kind, s, heads, dim, topk, requires_grad=False):
    """q, ori_kv, cmp_kv, sinks and the call's arguments for one sequence (BSND, B = 1)."""
    ratio = 4 if kind == "csa" else 128
    c = s // ratio
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, s, heads, dim, generator=g) * dim**-0.25).to(torch.bfloat16)
    ori = (torch.randn(1, s, 1, dim, generator=g) * dim**-0.25).to(torch.bfloat16)
    cmp = (torch.randn(1, c, 1, dim, generator=g) * dim**-0.25).to(torch.bfloat16)
    sinks = torch.zeros(heads)
    kwargs = dict(
        cmp_ratio=ratio, cmp_residual_kv=torch.tensor([s % ratio]), ori_mask_mode=4,
        cmp_mask_mode=3, ori_win_left=WINDOW - 1, ori_win_right=0, softmax_scale=dim**-0.5,
    )  # fmt: skip
    if kind == "csa":
        # A top-k of distinct entries each row has passed (its latest ones, in a shuffled
        # order; -1 past the first entry): what the indexer hands over, at the same count.
        passed = (torch.arange(s) + 1) // ratio
        idx = passed[:, None] - 1 - torch.randperm(topk, generator=g)[None, :]
        kwargs["cmp_sparse_indices"] = idx.clamp(min=-1).int().view(1, s, 1, topk)
    if requires_grad:
        for t in (q, ori, cmp, sinks):
            t.requires_grad_(True)
    return q, ori, cmp, sinks, kwargs


def row_keys(kind, s, topk):
    """Keys each row reads: its window and its compressed entries."""
    ratio = 4 if kind == "csa" else 128
    i = torch.arange(s)
    window = torch.clamp(i + 1, max=WINDOW)
    passed = (i + 1) // ratio
    return window + (torch.clamp(passed, max=topk) if kind == "csa" else passed)


def composition(q, ori, cmp, sinks, kwargs, chunk):
    """The attention in PyTorch, ``chunk`` query rows at a time: each row's window keys and
    compressed entries gathered into ``[chunk, K, D]`` (masked where a row has fewer), then
    ``einsum`` scores, the sink as one more logit, softmax, and the weighted sum."""
    s, heads, dim = q.shape[1], q.shape[2], q.shape[3]
    ratio = kwargs["cmp_ratio"]
    scale = kwargs["softmax_scale"]
    kv_o, kv_c = ori[0, :, 0], cmp[0, :, 0]
    idx_c = kwargs.get("cmp_sparse_indices")
    outs = []
    for c0 in range(0, s, chunk):
        i = torch.arange(c0, min(s, c0 + chunk))
        win = i[:, None] - torch.arange(WINDOW - 1, -1, -1)[None, :]  # [c, W]
        win_ok = win >= 0
        passed = (i + 1) // ratio
        if idx_c is None:
            ent = torch.arange(kv_c.shape[0])[None, :].expand(len(i), -1)
        else:
            ent = idx_c[0, c0 : c0 + len(i), 0].long()
        ent_ok = (ent >= 0) & (ent < passed[:, None])
        keys = torch.cat([kv_o[win.clamp(min=0)], kv_c[ent.clamp(min=0)]], dim=1)  # [c, K, D]
        ok = torch.cat([win_ok, ent_ok], dim=1)
        scores = torch.einsum("chd,ckd->chk", q[0, c0 : c0 + len(i)], keys).float() * scale
        scores = scores.masked_fill(~ok[:, None, :], float("-inf"))
        logits = torch.cat([scores, sinks.view(1, heads, 1).expand(len(i), heads, 1)], dim=-1)
        p = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)
        outs.append(torch.einsum("chk,ckd->chd", p, keys))
    return torch.cat(outs).view(1, s, heads, dim)


def ours(q, ori, cmp, sinks, kwargs):
    return opmesh.sparse_flash_mla(q, ori_kv=ori, cmp_kv=cmp, sinks=sinks, **kwargs)[0]


def with_backward(fn, leaves, grad):
    def run():
        for t in leaves:
            t.grad = None
        out = fn()
        out.backward(grad)

    return run


def bench_layer(args, rows):
    for kind in ("csa", "hca"):
        for s in args.seq:
            q, ori, cmp, sinks, kwargs = layer_inputs(kind, s, args.heads, args.dim, args.topk)
            keys = row_keys(kind, s, args.topk).sum().item()
            flops_fwd = keys * 4 * args.heads * args.dim
            want = ours(q, ori, cmp, sinks, kwargs)
            compiled = torch.compile(composition, dynamic=False)
            methods = {"opmesh": partial(ours, q, ori, cmp, sinks, kwargs)}
            chunks = [c for c in args.chunks if c <= s] if s <= args.compose_up_to else []
            for chunk in chunks:
                methods |= tier_compositions(
                    f"eager chunk {chunk}", composition, q, ori, cmp, sinks, kwargs, chunk
                )
                methods |= tier_compositions(
                    f"compiled chunk {chunk}", compiled, q, ori, cmp, sinks, kwargs, chunk
                )
            if chunks:
                got = methods[f"eager chunk {chunks[0]}"]()
                err = (got.float() - want.float()).abs().max().item()
            else:
                err = float("nan")
            add_rows(rows, kind, s, "forward", methods, flops_fwd, args, err)
            # Forward + backward: the backward reads every key twice more (2.5x the forward's
            # products).
            leaves_q = layer_inputs(kind, s, args.heads, args.dim, args.topk, requires_grad=True)
            lq, lo, lc, ls, lkw = leaves_q
            grad = torch.randn_like(want)
            both = {
                "opmesh": with_backward(partial(ours, lq, lo, lc, ls, lkw), [lq, lo, lc, ls], grad)
            }
            for chunk in chunks:
                for method, fn in tier_compositions(
                    f"eager chunk {chunk}", composition, lq, lo, lc, ls, lkw, chunk
                ).items():
                    both[method] = with_backward(fn, [lq, lo, lc, ls], grad)
            add_rows(rows, kind, s, "forward + backward", both, flops_fwd * 3.5, args, err)


def add_rows(rows, kind, s, phase, methods, flops, args, err):
    timed = {}
    for method, fn in methods.items():
        # The compositions take tens of seconds a call at S = 8192: one timed call after the
        # memory measurement's two (which warm them up).
        slow = method != "opmesh"
        extra = peak_extra_bytes(fn)
        seconds = time_call(fn, budget_s=0 if slow else args.budget, min_repeats=1 if slow else 3,
                            warm_up=False)  # fmt: skip
        timed[method] = seconds
        rows.append(
            dict(
                layer=kind.upper(), S=s, phase=phase, method=method, ms=round(seconds * 1e3, 1),
                GFLOPs=round(flops / seconds / 1e9, 1),
                pct_of_mm=None,  # filled in from the run's GEMM rate at the end
                extra_MB=round(extra / 2**20, 1),
                max_abs_err=f"{err:.1e}" if method == "opmesh" else "",
            )
        )  # fmt: skip
        print(rows[-1], flush=True)
    if len(timed) > 1:
        best = best_on_this_tier(timed, ["opmesh"])
        rows[-len(timed)]["vs_best_torch"] = f"{timed[best] / timed['opmesh']:.1f}x"


def bench_decode(args, rows):
    b, ctx, heads, dim, bs = args.batch, args.context, args.heads, args.dim, 64
    g = torch.Generator().manual_seed(1)
    c = ctx // 128
    blocks_o, blocks_c = b * math.ceil(ctx / bs), b * math.ceil(c / bs)

    def draw(*shape):
        return (torch.randn(*shape, generator=g) * dim**-0.25).to(torch.bfloat16)

    q = draw(b, 1, heads, dim)
    ori, cmp = draw(blocks_o, bs, 1, dim), draw(blocks_c, bs, 1, dim)
    table_o = torch.randperm(blocks_o, generator=g).view(b, -1).int()
    table_c = torch.randperm(blocks_c, generator=g).view(b, -1).int()
    kwargs = dict(
        ori_block_table=table_o, cmp_block_table=table_c, layout_kv="PA_BBND",
        seqused_ori_kv=torch.full((b,), ctx), seqused_cmp_kv=torch.full((b,), c), cmp_ratio=128,
        cmp_mask_mode=3, ori_mask_mode=4, ori_win_left=WINDOW - 1, ori_win_right=0,
        softmax_scale=dim**-0.5, sinks=torch.zeros(heads),
    )  # fmt: skip

    def ours_decode():
        return opmesh.sparse_flash_mla(q, ori_kv=ori, cmp_kv=cmp, **kwargs)[0]

    def composed(q, ori, cmp):
        # Each sequence's window and compressed rows gathered from the pages, then the same
        # attention as the layer composition.
        outs = []
        for i in range(b):
            w = torch.arange(ctx - WINDOW, ctx)
            kw = ori[table_o[i, w // bs].long(), w % bs, 0]
            e = torch.arange(c)
            kc = cmp[table_c[i, e // bs].long(), e % bs, 0]
            keys = torch.cat([kw, kc])
            s = (q[i, 0] @ keys.T).float() * dim**-0.5
            p = torch.softmax(torch.cat([s, torch.zeros(heads, 1)], dim=1), dim=1)[:, :-1]
            outs.append(p.to(keys.dtype) @ keys)
        return torch.stack(outs)

    read = b * (WINDOW + c) * dim * 2  # bytes of key/value rows
    flops = b * (WINDOW + c) * 4 * heads * dim
    methods = {"opmesh": ours_decode} | tier_compositions("gather + matmul", composed, q, ori, cmp)
    timed = {}
    for method, fn in methods.items():
        seconds = timed[method] = time_call(fn, budget_s=args.budget)
        rows.append(
            dict(
                layer="HCA decode", S=ctx, phase=f"B={b}", method=method,
                ms=round(seconds * 1e3, 3), GFLOPs=round(flops / seconds / 1e9, 1),
                GB_per_s=round(read / seconds / 1e9, 2),
            )
        )  # fmt: skip
        print(rows[-1], flush=True)
    best = best_on_this_tier(timed, ["opmesh"])
    rows[-len(timed)]["vs_best_torch"] = f"{timed[best] / timed['opmesh']:.1f}x"


def compressor_composition(x, wkv, wgate, ape, ratio, coff):
    """transformers' DeepseekV4CSACompressor / HCACompressor (before their norm and rotary
    embedding) on whole windows: projections, the windows (and, with coff = 2, the previous
    window's first half) laid out, softmax in float32, weighted sum."""
    b, s, _ = x.shape
    d = wkv.shape[0] // coff
    n = s // ratio
    kv = (x[:, : n * ratio] @ wkv.T).view(b, n, ratio, coff * d)
    gate = (x[:, : n * ratio] @ wgate.T).view(b, n, ratio, coff * d) + ape.to(x.dtype)
    if coff == 2:
        prev_kv = torch.cat([torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]], dim=1)
        prev_gate = torch.cat(
            [torch.full_like(gate[:, :1, :, :d], float("-inf")), gate[:, :-1, :, :d]], dim=1
        )
        kv = torch.cat([prev_kv, kv[..., d:]], dim=2)
        gate = torch.cat([prev_gate, gate[..., d:]], dim=2)
    weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    return (kv * weights).sum(dim=2)


def run_compressor(x, wkv, wgate, ape, ratio, coff):
    return opmesh.compressor(x, wkv, wgate, None, ape, ratio, coff=coff)


def bench_compressor(args, rows):
    for kind, ratio, coff in (("CSA", 4, 2), ("HCA", 128, 1)):
        for s in args.seq:
            g = torch.Generator().manual_seed(2)
            h, d = args.hidden, args.dim

            def draw(*shape, scale=1.0, g=g):
                return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

            x = draw(1, s, h)
            wkv, wgate = draw(coff * d, h, scale=h**-0.5), draw(coff * d, h, scale=h**-0.5)
            ape = torch.randn(ratio, coff * d, generator=g)
            flops = 2 * 2 * coff * d * h * s
            want = opmesh.compressor(x, wkv, wgate, None, ape, ratio, coff=coff)[:, : s // ratio]
            got = compressor_composition(x, wkv, wgate, ape, ratio, coff)
            err = (got.float() - want.float()).abs().max().item()
            compiled = torch.compile(compressor_composition, dynamic=False)
            methods = {"opmesh": partial(run_compressor, x, wkv, wgate, ape, ratio, coff)}
            for label, fn in (("eager", compressor_composition), ("compiled", compiled)):
                methods |= tier_compositions(label, fn, x, wkv, wgate, ape, ratio, coff)
            add_rows(rows, kind + " compressor", s, "forward", methods, flops, args, err)
            leaves = [t.clone().requires_grad_(True) for t in (x, wkv, wgate, ape)]
            grad = torch.randn(want.shape, generator=g).to(torch.bfloat16)
            grad_full = torch.zeros(1, -(-s // ratio), d, dtype=torch.bfloat16)
            grad_full[:, : s // ratio] = grad
            lx, lw, lg, la = leaves
            both = {
                "opmesh": with_backward(
                    partial(run_compressor, lx, lw, lg, la, ratio, coff), leaves, grad_full
                )
            }
            for method, fn in tier_compositions(
                "eager", compressor_composition, lx, lw, lg, la, ratio, coff
            ).items():
                both[method] = with_backward(fn, leaves, grad)
            add_rows(rows, kind + " compressor", s, "forward + backward", both, flops * 3, args,
                     err)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["layer", "decode"])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512])
    # The longest S the compositions run at (they take minutes a call beyond).
    parser.add_argument("--compose-up-to", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=3.0)
    parser.add_argument("--name", default="v4")
    args = parser.parse_args()
    # This machine's GEMM rate in the precision the layers' products run in on this tier (bf16,
    # or float32 where the tier has no bf16 products): what the products can reach.
    args.mm_dtype = tier_matmul_dtype(torch.bfloat16)
    a, b = (torch.randn(4096, 4096).to(args.mm_dtype) for _ in range(2))
    mm = as_on_this_tier(partial(torch.mm, a, b))
    before = 2 * 4096**3 / time_call(mm, budget_s=2.0) / 1e9
    rows = []
    if "layer" in args.parts:
        bench_layer(args, rows)
    if "decode" in args.parts:
        bench_decode(args, rows)
    if "compressor" in args.parts:
        bench_compressor(args, rows)
    # Timed again at the end: the faster of the two is what the machine's GEMM reaches (a VM's
    # speed drifts for minutes at a time).
    args.mm = max(before, 2 * 4096**3 / time_call(mm, budget_s=2.0) / 1e9)
    for row in rows:
        if "pct_of_mm" in row:
            row["pct_of_mm"] = f"{100 * row['GFLOPs'] / args.mm:.0f}%"
    columns = ["layer", "S", "phase", "method", "ms", "GFLOPs", "pct_of_mm", "extra_MB",
               "GB_per_s", "vs_best_torch", "max_abs_err"]  # fmt: skip
    notes = [
        f"pct_of_mm: GFLOP/s over a {str(args.mm_dtype).removeprefix('torch.')} torch.mm of "
        f"4096 x 4096 x 4096 timed at the start and the end of this run, the faster "
        f"({args.mm:.0f} GFLOP/s): the rate this machine's "
        "GEMM reaches on this tier.",
        "vs_best_torch: the fastest PyTorch composition a machine of this run's tier runs (bf16 "
        "as torch runs it there, or on inputs made float32 where the tier has no bf16 products) "
        "over opmesh's time.",
    ]
    if "layer" in args.parts or "decode" in args.parts:
        notes += [
            "GFLOP/s counts the keys each row reads x 4 N1 D (x 3.5 with the backward). The "
            "compositions gather each chunk's keys and run batched matmuls (eager, and compiled "
            "forward).",
            "extra_MB is the peak resident memory a call adds, its output included (S x 64 x 512 "
            "bf16: 512 MB at S = 8192); opmesh's forward adds O(tile) beyond it, its backward also "
            "two spans' kept P and dS (at most 64 MiB each) and the float32 sums of the key blocks "
            "a span reaches. Decode with 64 query heads on one key head is compute-bound "
            "(GB_per_s: the key/value rows read).",
        ]
    if "compressor" in args.parts:
        notes.append(
            "Compressor rows: GFLOP/s counts the projections' products (2 x 2 coff D x H per "
            "token, x 3 with the backward: both keep the projections from the forward). The "
            "composition is transformers' formulation on whole windows in "
            "bf16; max_abs_err is the largest difference between the two outputs (opmesh "
            "accumulates in float32 and rounds once)."
        )
    print(write_results(args.name, rows, columns, notes, tier_baselines=True))


if __name__ == "__main__":
    main()
