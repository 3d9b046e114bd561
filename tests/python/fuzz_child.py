"""The child process of test_fuzz.py: ``python fuzz_child.py OP SEED COUNT [CASE] [--compiled]``.

Generates COUNT seeded cases for OP, runs each, and prints ``CASE i`` before each call (so a
crash can be traced to its case) and one ``RESULT {json}`` line at the end: how many calls gave
a correct result, how many were refused by name, and every case that did neither. With CASE,
runs that case alone and prints its arguments. With ``--compiled``, the unmutated cases run
through ``torch.compile(fullgraph=True)`` (static sizes for even cases, dynamic for odd ones)
and must give the checked result: a valid call that fails to compile fails.
"""

import dataclasses
import json
import math
import random
import sys

import torch
import torch.utils._pytree as pytree
from attention_reference import flash_attn_reference
from reference import UNBOUNDED, indexer_softmax_lse, lightning_indexer_scores
from reference import compressor as compressor_reference
from reference import sparse_flash_attention as sparse_attention_reference
from reference import sparse_flash_mla as mla_reference
from test_indexer_kl_loss import TOLERANCES as KL_TOLERANCES
from test_indexer_kl_loss import Case
from test_indexer_kl_loss import make as kl_make
from test_indexer_kl_loss import reference as dense_kl_reference
from test_indexer_kl_loss import sequences as kl_sequences
from test_quantized_cache import FORMATS, dequantize, quantize
from test_sparse_indexer_kl_loss import reference as sparse_kl_reference
from test_sparse_indexer_kl_loss import selection as kl_selection
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

import opmesh

COMPILED = "--compiled" in sys.argv
argv = [a for a in sys.argv[1:] if a != "--compiled"]
op_name, seed, count = argv[0], int(argv[1]), int(argv[2])
rng = random.Random(seed)
gen = torch.Generator().manual_seed(seed)
torch.set_num_threads(rng.choice([1, 2]))

KL_ARGUMENTS = [
    "query",
    "key",
    "query_index",
    "key_index",
    "weights",
    "softmax_max",
    "softmax_sum",
    "scale_value",
    "query_rope",
    "key_rope",
    "actual_seq_qlen",
    "actual_seq_klen",
    "layout",
    "sparse_mode",
    "pre_tokens",
    "next_tokens",
    "cmp_ratio",
    "cmp_residual_key",
]
ARGUMENTS = {
    "dense_lightning_indexer_grad_kl_loss": KL_ARGUMENTS
    + ["softmax_max_index", "softmax_sum_index"],
    "sparse_lightning_indexer_grad_kl_loss": KL_ARGUMENTS + ["sparse_indices"],
    "flash_attn": [
        "q",
        "k",
        "v",
        "k_scale",
        "v_scale",
        "block_table",
        "cu_seqlens_q",
        "cu_seqlens_kv",
        "seqused_q",
        "seqused_kv",
        "sinks",
        "metadata",
        "softmax_scale",
        "mask_mode",
        "win_left",
        "win_right",
        "max_seqlen_q",
        "max_seqlen_kv",
        "layout_q",
        "layout_kv",
        "layout_out",
        "num_heads_q",
        "num_heads_kv",
        "head_dim",
        "head_dim_v",
        "batch_size",
    ],
    "flash_attn_metadata": [
        "num_heads_q",
        "num_heads_kv",
        "head_dim",
        "head_dim_v",
        "cu_seqlens_q",
        "cu_seqlens_kv",
        "seqused_q",
        "seqused_kv",
        "batch_size",
        "max_seqlen_q",
        "max_seqlen_kv",
        "mask_mode",
        "win_left",
        "win_right",
        "layout_q",
        "layout_kv",
        "layout_out",
        "num_workers",
    ],
    "indexer": [
        "query_index",
        "key_index",
        "weights",
        "actual_seq_qlen",
        "actual_seq_klen",
        "layout",
        "sparse_mode",
        "pre_tokens",
        "next_tokens",
        "cmp_ratio",
        "cmp_residual_key",
        "batch",
    ],
    "kv_cache_write_": [
        "key",
        "value",
        "key_cache",
        "value_cache",
        "slot_mapping",
        "key_scale",
        "value_scale",
    ],
    "describe_metadata": ["metadata"],
    "sparse_flash_mla": [
        "q",
        "ori_kv",
        "cmp_kv",
        "ori_sparse_indices",
        "cmp_sparse_indices",
        "ori_block_table",
        "cmp_block_table",
        "cu_seqlens_q",
        "cu_seqlens_ori_kv",
        "cu_seqlens_cmp_kv",
        "seqused_q",
        "seqused_ori_kv",
        "seqused_cmp_kv",
        "cmp_residual_kv",
        "ori_topk_length",
        "cmp_topk_length",
        "sinks",
        "softmax_scale",
        "ori_kv_scale",
        "cmp_kv_scale",
        "cmp_ratio",
        "ori_mask_mode",
        "cmp_mask_mode",
        "ori_win_left",
        "ori_win_right",
        "layout_q",
        "layout_kv",
        "topk_value_mode",
    ],
    "sparse_flash_attention": [
        "query",
        "key",
        "value",
        "sparse_indices",
        "scale_value",
        "key_scale",
        "value_scale",
        "block_table",
        "actual_seq_lengths_query",
        "actual_seq_lengths_kv",
        "query_rope",
        "key_rope",
        "sparse_block_size",
        "layout_query",
        "layout_kv",
        "sparse_mode",
        "pre_tokens",
        "next_tokens",
        "attention_mode",
        "softcap",
        "sinks",
    ],
    "lightning_indexer": [
        "query",
        "key",
        "weights",
        "actual_seq_lengths_query",
        "actual_seq_lengths_key",
        "block_table",
        "layout_query",
        "layout_key",
        "sparse_count",
        "sparse_mode",
        "pre_tokens",
        "next_tokens",
        "scale_value",
        "cmp_ratio",
        "cmp_residual_key",
    ],
    "compressor": [
        "x",
        "wkv",
        "wgate",
        "state_cache",
        "ape",
        "cmp_ratio",
        "state_block_table",
        "cu_seqlens",
        "seqused",
        "start_pos",
        "coff",
        "cache_mode",
        "projections",
    ],
}[op_name]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def pick(*options):
    return rng.choice(options)


def size():
    return pick(0, 1, 2, 3, 5, 7, 16, 17, 33, 65)


def tensor(*shape, dtype=torch.float32):
    mode = rng.random()
    if mode < 0.05 and all(s > 0 for s in shape):
        return torch.zeros([1] * len(shape), dtype=dtype).expand(*shape)  # stride 0
    t = torch.randn(*shape, generator=gen).to(dtype)
    if mode < 0.10 and t.numel():
        t.view(-1)[rng.randrange(t.numel())] = pick(math.nan, math.inf, -math.inf)
    if mode > 0.9 and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous, same values
    return t


def lengths(count, limit, cumulative):
    mode = rng.random()
    if mode < 0.7:
        vals = [rng.randint(0, max(0, limit)) for _ in range(count)]
        if cumulative:
            out = [0]
            for v in vals:
                out.append(out[-1] + v)
            vals = out
    else:
        vals = [
            rng.choice([-1, 0, 1, limit, limit + 1, 2**31 - 1, 2**40])
            for _ in range(count + rng.choice([0, 1]))
        ]
    if rng.random() < 0.05:
        vals = [float(v) + 0.5 for v in vals]
    kind = rng.random()
    if kind < 0.4:
        return vals
    if kind < 0.95:
        dtype = pick(torch.int32, torch.int32, torch.int64, torch.float32)
        try:
            return torch.tensor(vals, dtype=dtype)
        except (RuntimeError, OverflowError):
            return vals
    return torch.tensor([int(v) for v in vals if abs(v) < 2**31], dtype=torch.int32).to("meta")


def total(vals, fallback):
    # The token count a cumulative array ends with, when it is a usable one.
    if isinstance(vals, torch.Tensor):
        if vals.device.type == "meta" or vals.numel() == 0:
            return fallback
        vals = vals.tolist()
    if not vals:
        return fallback
    last = vals[-1]
    return int(last) if 0 <= last < 4096 else fallback


def flash_attn_case():
    """A valid call (every layout, paged keys, GQA, masks and windows, sinks, scales, lengths with
    empty sequences, quantized caches), then, one call in four, one mutation."""
    layout = pick("BSND", "BNSD", "TND", "TND")
    paged = layout != "TND" and rng.random() < 0.25
    b, s1, s2 = pick(0, 1, 2, 3), size(), size() if rng.random() < 0.8 else pick(1025, 2100)
    nkv = pick(1, 2, 3)
    nq = nkv * pick(1, 2, 4)
    d, dv = pick(8, 16, 17, 64), pick(8, 16, 24)
    dtype = pick(*DTYPES)
    kw = dict(mask_mode=pick(0, 3, 4, 4))
    if kw["mask_mode"] == 4:
        kw.update(win_left=pick(-1, 0, 1, 5, 2**31), win_right=pick(-1, 0, 2, 2**40))
    if rng.random() < 0.2:
        kw["sinks"] = tensor(nq)
    if rng.random() < 0.1:
        kw["softmax_scale"] = pick(0.0, 1e-3, -0.5, 3.0)
    if layout == "TND":
        q_lens = [rng.randint(0, s1) for _ in range(b)]
        k_lens = [rng.randint(0, s2) for _ in range(b)]
        q = tensor(sum(q_lens), nq, d, dtype=dtype)
        k = tensor(sum(k_lens), nkv, d, dtype=dtype)
        v = tensor(sum(k_lens), nkv, dv, dtype=dtype)
        kw.update(cu_seqlens_q=cumulative(q_lens), cu_seqlens_kv=cumulative(k_lens))
        kw.update(layout_q="TND", layout_kv="TND", layout_out="TND")
    else:
        rows = (b, s1, nq) if layout == "BSND" else (b, nq, s1)
        q = tensor(*rows, d, dtype=dtype)
        kw.update(layout_q=layout, layout_out=pick(layout, "BSND", "BNSD"))
        if paged:
            bs, blocks, per_seq = pick(1, 4, 16), pick(1, 3, 8), pick(1, 2, 4)
            k = tensor(blocks, bs, nkv, d, dtype=dtype)
            v = tensor(blocks, bs, nkv, dv, dtype=dtype)
            table = torch.randint(0, blocks, (b, per_seq), generator=gen, dtype=torch.int32)
            used = [rng.randint(0, bs * per_seq) for _ in range(b)]
            kw.update(layout_kv="PA_BBND", block_table=table, seqused_kv=used)
        else:
            kw["layout_kv"] = layout
            keys = (b, s2, nkv) if layout == "BSND" else (b, nkv, s2)
            k, v = tensor(*keys, d, dtype=dtype), tensor(*keys, dv, dtype=dtype)
        if rng.random() < 0.3:
            kw["seqused_q"] = [rng.randint(0, s1) for _ in range(b)]
    if rng.random() < 0.15:  # a quantized cache (bytes and a scale per row and head)
        fmt = FORMATS[pick("int8", "fp8")]
        (k, kw["k_scale"]), (v, kw["v_scale"]) = quantize(k, fmt), quantize(v, fmt)
    if rng.random() < 0.3:
        kw["return_softmax_lse"] = True
    kind = rng.random()
    MUTATED[0] = kind < 0.25
    if kind < 0.02:
        q = q.double() if rng.random() < 0.5 else q.int()
    elif kind < 0.04:
        k = k[..., :-1] if k.shape[-1] > 1 else k
    elif kind < 0.06:
        kw[pick("layout_q", "layout_kv", "layout_out")] = pick("BSND", "TND", "PA_BBND", "bsnd", "")
    elif kind < 0.08:
        q = q.unsqueeze(0)
    elif kind < 0.1:
        kw["max_seqlen_q"] = pick(-1, 0, 3, 2**40)
    elif kind < 0.12:
        kw["mask_mode"] = pick(1, -1, 2, 2**32 + 3)
    elif kind < 0.14:
        kw["win_left" if rng.random() < 0.5 else "win_right"] = pick(2**63 - 1, -2, -(2**62))
    elif kind < 0.16:
        kw["sinks"] = tensor(nq + 1)
    elif kind < 0.18:
        kw["softmax_scale"] = pick(math.inf, math.nan, 1e39)
    elif kind < 0.22:
        names = [n for n in ("cu_seqlens_q", "cu_seqlens_kv", "seqused_q", "seqused_kv") if n in kw]
        name = pick(*names) if names else "seqused_q"
        kw[name] = lengths(b, pick(s1, s2, 8), name.startswith("cu"))
    elif kind < 0.23 and "block_table" in kw and kw["block_table"].numel():
        kw["block_table"].view(-1)[0] = pick(-1, 2**20)
    elif kind < 0.25 and "k_scale" in kw:
        name = pick("k_scale", "v_scale")
        kw[name] = kw[name][..., :-1] if rng.random() < 0.5 else kw[name].half()
    return (q, k, v), kw


def check_flash_attn(args, kw, result):
    q, k, v = args
    out, lse = result
    ref_kw = {key: (torch.tensor(val) if isinstance(val, list) else val) for key, val in kw.items()}
    if "k_scale" in ref_kw:  # the reference reads the rows a quantized cache stands for
        k, v = dequantize(k, ref_kw.pop("k_scale")), dequantize(v, ref_kw.pop("v_scale"))
    if ref_kw.get("mask_mode") == 4:
        for side in ("win_left", "win_right"):
            if ref_kw.get(side, -1) >= 2**31 - 256:
                ref_kw[side] = -1
    ref_out, ref_lse = flash_attn_reference(q.float(), k.float(), v.float(), **ref_kw)
    tol = 2e-2 if q.dtype != torch.float32 else 2e-4
    sinks = kw.get("sinks")
    finite = all(torch.isfinite(t).all() for t in (q, k, v) + (() if sinks is None else (sinks,)))

    def differs(got, want):
        bad = ~torch.isclose(got.double(), want, atol=tol, rtol=tol, equal_nan=True)
        if not finite:
            # Documented: a non-finite input reaches the rows it touches as NaN (for a key or
            # value: every row of the query tiles that load its key tile, 0 * inf; for a NaN
            # sink: its head's rows), in the output and in the lse alike (where the reference's
            # logsumexp of an infinite score is inf, and its probabilities turn NaN into 0).
            bad &= ~got.double().isnan() & ~want.isnan()
        return bad

    bad = differs(out, ref_out)
    if bad.any():
        raise AssertionError(f"output differs from the reference at {bad.nonzero()[:3].tolist()}")
    if kw.get("return_softmax_lse"):
        bad = differs(lse, ref_lse)
        if bad.any():
            raise AssertionError(f"lse differs from the reference at {bad.nonzero()[:3].tolist()}")
    # Half the finite calls on unquantized, unpaged keys: every input's gradient too.
    if finite and "k_scale" not in kw and kw["layout_kv"] != "PA_BBND" and rng.random() < 0.5:
        names = ["sinks"] if "sinks" in kw else []
        check_gradients(
            lambda t: opmesh.flash_attn(*t[:3], **{**kw, **dict(zip(names, t[3:], strict=True))}),
            lambda t: flash_attn_reference(
                *t[:3], **{**ref_kw, **dict(zip(names, t[3:], strict=True))}
            ),
            [q, k, v] + [kw[n] for n in names],
            lambda out: (out[0], out[1]) if kw.get("return_softmax_lse") else (out[0],),
            GRADIENT_TOL.get(q.dtype, GRADIENT_TOL[torch.float32]),
        )


def metadata_case():
    """A valid call (every layout, masks and windows, worker counts), then, one call in three,
    one mutation."""
    b = pick(0, 1, 3)
    kw = dict(
        batch_size=b,
        max_seqlen_q=64,
        max_seqlen_kv=200,
        mask_mode=pick(0, 3, 4),
        num_workers=pick(None, 1, 7),
        deterministic=pick(False, True),
    )
    if kw["mask_mode"] == 4:
        kw.update(win_left=pick(-1, 3, 2**62), win_right=pick(-1, 0, 5))
    layout = pick("BSND", "TND", "PA_BBND")
    if layout == "TND":
        ends_q = [0] + sorted(rng.randint(0, 64) for _ in range(b))
        ends_k = [0] + sorted(rng.randint(0, 200) for _ in range(b))
        kw["cu_seqlens_q"] = ends_q
        kw.update(cu_seqlens_kv=ends_k, layout_q="TND", layout_kv="TND", layout_out="TND")
        kw["max_seqlen_q"] = max([y - x for x, y in zip(ends_q, ends_q[1:], strict=False)] or [0])
        kw["max_seqlen_kv"] = max([y - x for x, y in zip(ends_k, ends_k[1:], strict=False)] or [0])
    elif layout == "PA_BBND":
        kw.update(layout_kv="PA_BBND", seqused_kv=[rng.randint(0, 200) for _ in range(b)])
    heads = [4, 2, 16]
    MUTATED[0] = rng.random() < 0.35
    if MUTATED[0]:
        which = rng.randrange(6)
        if which == 0:
            heads[rng.randrange(3)] = pick(0, -1, 3, 2**17, 2**40)
        elif which == 1:
            kw[pick("batch_size", "max_seqlen_q", "max_seqlen_kv")] = pick(-1, 2**31, 2**37)
        elif which == 2:
            kw["mask_mode"] = pick(1, 2, -3, 2**33)
        elif which == 3:
            kw[pick("win_left", "win_right")] = pick(-2, 5, 2**63 - 1)
        elif which == 4:
            kw["num_workers"] = pick(0, -1, 2**17)
        else:
            name = pick("cu_seqlens_q", "cu_seqlens_kv", "seqused_q", "seqused_kv")
            kw[name] = lengths(b, 64, name.startswith("cu"))
    return tuple(heads), kw


def check_metadata(args, kw, result):
    """A plan never changes the answer: flash_attn on random inputs of the planned shapes gives
    with the plan what it gives without one (the same sums in another order: float32 rounding)."""
    hq, hkv, d = args
    layout_kv = kw.get("layout_kv", kw.get("layout_q", "BSND"))
    call = {n: kw[n] for n in ("mask_mode", "win_left", "win_right") if n in kw}
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "seqused_q", "seqused_kv"):
        if name in kw:
            call[name] = torch.as_tensor(kw[name]).to(torch.int32)
    b = kw["batch_size"]
    if kw.get("layout_q") == "TND":
        q = torch.randn(kw["cu_seqlens_q"][-1], hq, d, generator=gen)
        k, v = (torch.randn(kw["cu_seqlens_kv"][-1], hkv, d, generator=gen) for _ in range(2))
        call.update(layout_q="TND", layout_kv="TND", layout_out="TND")
        call.update(max_seqlen_q=kw["max_seqlen_q"], max_seqlen_kv=kw["max_seqlen_kv"])
    else:
        q = torch.randn(b, kw["max_seqlen_q"], hq, d, generator=gen)
        if layout_kv == "PA_BBND":
            per = -(-kw["max_seqlen_kv"] // 16)
            k, v = (torch.randn(b * per + 1, 16, hkv, d, generator=gen) for _ in range(2))
            table = torch.randperm(b * per + 1, generator=gen)[: b * per].view(b, per)
            call.update(layout_kv="PA_BBND", block_table=table.int())
            call["max_seqlen_kv"] = kw["max_seqlen_kv"]
        else:
            k, v = (torch.randn(b, kw["max_seqlen_kv"], hkv, d, generator=gen) for _ in range(2))
    plain = opmesh.flash_attn(q, k, v, return_softmax_lse=True, **call)
    planned = opmesh.flash_attn(q, k, v, metadata=result, return_softmax_lse=True, **call)
    for name, a, b_ in zip(("output", "lse"), planned, plain, strict=True):
        if not torch.allclose(a, b_, atol=2e-5, rtol=2e-5, equal_nan=True):
            raise AssertionError(f"the planned call's {name} differs from the unplanned one's")


def indexer_case():
    """A valid call (BSND and TND, lengths with empty sequences, GQA, masks, bands, compressed
    keys, float32 weights beside half inputs), then, one call in four, one mutation."""
    layout = pick("BSND", "TND")
    b, s1, s2 = pick(0, 1, 2), size(), size()
    n2 = pick(1, 2)
    n1 = n2 * pick(1, 3)
    d, dtype = pick(1, 16, 33, 128), pick(*DTYPES)
    kw = dict(layout=layout, sparse_mode=pick(0, 3, 3))
    if rng.random() < 0.3:
        kw.update(pre_tokens=pick(UNBOUNDED, 0, 3), next_tokens=pick(UNBOUNDED, 0, 2))
    elif rng.random() < 0.2:
        ratio = pick(2, 4)
        kw["cmp_ratio"] = ratio
        if kw["sparse_mode"] == 3:
            kw["cmp_residual_key"] = [rng.randrange(ratio) for _ in range(b)]
    if layout == "TND":
        ends_q = cumulative([rng.randint(0, s1) for _ in range(b)])[1:]
        ends_k = cumulative([rng.randint(0, s2) for _ in range(b)])[1:]
        tq, tk = (ends_q or [0])[-1], (ends_k or [0])[-1]
        args = (tensor(tq, n1, d, dtype=dtype), tensor(tk, n2, d, dtype=dtype), tensor(tq, n1))
        kw.update(actual_seq_qlen=ends_q, actual_seq_klen=ends_k)
    else:
        args = (
            tensor(b, s1, n1, d, dtype=dtype),
            tensor(b, s2, n2, d, dtype=dtype),
            tensor(b, s1, n1),
        )
        if rng.random() < 0.4:
            kw["actual_seq_qlen"] = [rng.randint(0, s1) for _ in range(b)]
        if rng.random() < 0.4:
            kw["actual_seq_klen"] = [rng.randint(0, s2) for _ in range(b)]
    if rng.random() < 0.5:
        args = (args[0], args[1], args[2].to(dtype))
    kind = rng.random()
    MUTATED[0] = kind < 0.25
    if kind < 0.03:
        args = (args[0], args[1], args[2].double())
    elif kind < 0.06:
        args = (args[0].int(), args[1], args[2])
    elif kind < 0.09:
        args = (args[0], args[1][..., :-1] if d > 1 else args[1], args[2])
    elif kind < 0.12:
        kw["layout"] = pick("BNSD", "bsnd", "", "TND" if layout == "BSND" else "BSND")
    elif kind < 0.15:
        kw[pick("sparse_mode", "cmp_ratio", "pre_tokens")] = pick(1, -1, 2**32 + 3)
    elif kind < 0.2:
        name = pick("actual_seq_qlen", "actual_seq_klen")
        kw[name] = lengths(b, pick(s1, s2), False)
        if layout == "TND" and isinstance(kw[name], list):
            kw[name] = cumulative(kw[name])[1:]
    elif kind < 0.23:
        args = (tensor(*args[0].shape[:-1], 2049, dtype=dtype), args[1], args[2])
    elif kind < 0.25:
        args = (args[0], args[1], args[2][..., :-1])
    return args, kw


def check_indexer(args, kw, result):
    ref_kw = {key: (torch.tensor(val) if isinstance(val, list) else val) for key, val in kw.items()}
    want = indexer_softmax_lse(*args, **ref_kw)
    tol = 2e-2 if args[0].dtype != torch.float32 else 2e-4
    finite = all(torch.isfinite(t).all() for t in args)
    for got, ref in zip(result, want, strict=True):
        bad = ~torch.isclose(got.double(), ref, atol=tol, rtol=tol, equal_nan=True)
        if not finite:  # non-finite inputs may give NaN statistics in the rows they reach
            bad &= ~got.isnan() & ~ref.isnan()
        if bad.any():
            raise AssertionError(f"differs from the reference at {bad.nonzero()[:3].tolist()}")


def kv_case():
    t, n, d, dv = size(), pick(1, 2), pick(1, 8, 16), pick(1, 8)
    blocks, bs = pick(1, 2, 5), pick(1, 4)
    dtype = pick(*DTYPES)
    key, value = tensor(t, n, d, dtype=dtype), tensor(t, n, dv, dtype=dtype)
    kc, vc = torch.zeros(blocks, bs, n, d, dtype=dtype), torch.zeros(blocks, bs, n, dv, dtype=dtype)
    # Distinct slots, some -1 (skipped); the slot table a list or an int32/int64 tensor.
    slots = rng.sample(range(blocks * bs), min(t, blocks * bs)) + [-1] * (t - blocks * bs)
    slots = [x if rng.random() < 0.9 else -1 for x in slots]
    if rng.random() < 0.5:
        slots = torch.tensor(slots, dtype=pick(torch.int32, torch.int64))
    mode = rng.random()
    MUTATED[0] = mode < 0.3
    if mode < 0.05:
        # Overlap PyTorch's in-place ops detect (dense tensors sharing memory); strided views
        # whose overlap is too hard to decide are accepted, as PyTorch accepts them.
        vc = kc.view(vc.shape) if dv == d else vc
    elif mode < 0.1:
        kc = torch.zeros(1, bs, n, d, dtype=dtype).expand(blocks, bs, n, d)
    elif mode < 0.15:
        slots = list(range(t)) + [0] if t else [0]
    elif mode < 0.3:
        slots = lengths(t, blocks * bs - 1, False)
    kw = {}
    if rng.random() < 0.3:  # a quantized cache: bytes and a float32 scale per row and head
        fmt = FORMATS[pick("int8", "fp8")]
        kc, vc = kc.to(fmt), vc.to(fmt)
        kw = dict(key_scale=torch.zeros(blocks, bs, n), value_scale=torch.zeros(blocks, bs, n))
        kind = rng.random()
        MUTATED[0] |= kind < 0.25
        if kind < 0.1:
            del kw[pick("key_scale", "value_scale")]
        elif kind < 0.2:
            name = pick("key_scale", "value_scale")
            kw[name] = kw[name][..., :-1] if rng.random() < 0.5 else kw[name].double()
        elif kind < 0.25:
            vc = vc.float()
    BEFORE["caches"] = [
        None if x is None else x.clone()
        for x in (kc, vc, kw.get("key_scale"), kw.get("value_scale"))
    ]
    return (key, value, kc, vc, slots), kw


def bits(t):
    width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]
    return t.contiguous().view(width)


def check_kv(args, kw, result):
    """Each token's key and value rows in their slot (quantized: the bytes and scales of torch's
    quantizer), every other slot as it was."""
    key, value, kc, vc, slots = args
    slots = [int(s) for s in (slots.tolist() if isinstance(slots, torch.Tensor) else slots)]
    scales = kw.get("key_scale"), kw.get("value_scale")
    want = BEFORE["caches"]  # this case's copies, written here as the call should have
    for t, s in enumerate(slots):
        if s < 0:
            continue
        at = (s // kc.shape[1], s % kc.shape[1])
        for side, (rows, cache) in enumerate(((key, kc), (value, vc))):
            if scales[side] is None:
                want[side][at] = rows[t]
            else:
                want[side][at], want[2 + side][at] = quantize(rows[t], cache.dtype)
    for name, got, expected in zip(("key_cache", "value_cache", "key_scale", "value_scale"),
                                   (kc, vc) + scales, want, strict=True):  # fmt: skip
        if got is not None and not torch.equal(bits(got), bits(expected)):
            raise AssertionError(f"{name} differs from the writes at slots {slots[:8]}")


def describe_case():
    plan = opmesh.flash_attn_metadata(4, 2, 16, batch_size=2, max_seqlen_q=70, max_seqlen_kv=90)
    words = plan.clone()
    for _ in range(rng.choice([1, 2, 5])):
        words[rng.randrange(words.numel())] = rng.choice([-1, 0, 1, 3, 2**31 - 1, -(2**31)])
    if rng.random() < 0.2:
        words = words[: rng.randrange(words.numel())]
    return (words,), {}


# The sparse operators' cases: sequences of a few tokens (the references run row by row), keys
# as BSND / TND tensors or paged, selections of distinct positions with -1 among them; now and
# then one mutation that must be refused by name.


def sequence_lengths(b, extra):
    """Per-sequence query lengths and key lengths (each at least its query length)."""
    q = [pick(0, 1, 2, 3, 7, 17) for _ in range(b)]
    return q, [n + pick(*extra) for n in q]


def cumulative(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def key_tensor(layout, b, lens, heads, d, dtype, block_size=None):
    """Keys of `lens` per sequence: BSND ``[b, max, heads, d]``, TND ``[sum, heads, d]``, or
    paged ``[blocks, block_size, heads, d]`` with its block table (the blocks shuffled)."""
    if layout == "TND":
        return tensor(sum(lens), heads, d, dtype=dtype), None
    if layout == "BSND":
        return tensor(b, max(lens, default=0), heads, d, dtype=dtype), None
    per = [max(1, -(-n // block_size)) for n in lens]
    order = torch.randperm(sum(per) + 1, generator=gen).tolist()
    table = torch.zeros(b, max(per, default=1), dtype=torch.int32)
    for i in range(b):
        for j in range(per[i]):
            table[i, j] = order.pop()
    return tensor(sum(per) + 1, block_size, heads, d, dtype=dtype), table


def selection(rows_per_seq, limits, heads, k):
    """``[rows, heads, k]`` int32 distinct entries below each row's sequence limit, some -1;
    now and then a repeated or out-of-range entry (refused by name)."""
    rows = []
    for n, limit in zip(rows_per_seq, limits, strict=True):
        for _ in range(n):
            row = []
            for _ in range(heads):
                chosen = rng.sample(range(limit), min(k, limit))
                chosen = [c if rng.random() < 0.85 else -1 for c in chosen]
                row.append(chosen + [-1] * (k - len(chosen)))
            rows.append(row)
    idx = torch.tensor(rows, dtype=torch.int32).view(len(rows), heads, k)
    if rng.random() < 0.05 and idx.numel() >= 2:
        MUTATED[0] = True
        idx.view(-1)[rng.randrange(idx.numel())] = pick(limits[0] + 5 if limits else 3, -2)
    return idx


# Whether the current case's generator made a change that may make the call invalid. For the ops
# in STRICT, whose generators otherwise make valid calls only, a refusal of a call without one is
# a failure.
MUTATED = [False]
STRICT = {
    "compressor",
    "flash_attn_metadata",
    "kv_cache_write_",
    "flash_attn",
    "indexer",
    "sparse_flash_mla",
    "sparse_flash_attention",
    "lightning_indexer",
    "dense_lightning_indexer_grad_kl_loss",
    "sparse_lightning_indexer_grad_kl_loss",
}


def mutate(q, cut, kw, layouts, enums, arrays, b):
    """One call in five, one mutation a call must refuse by name: q's dtype, `cut`'s head dim, a
    layout argument, an enum argument (`enums`: names, then the values to try) or a per-sequence
    array (cumulative when its name starts with "cu"). Returns q and `cut`."""
    kind = rng.random()
    MUTATED[0] |= kind < 0.2
    if kind < 0.04:
        q = q.double() if rng.random() < 0.5 else q.int()
    elif kind < 0.08:
        cut = cut[..., :-1] if cut.shape[-1] > 1 else cut
    elif kind < 0.12:
        kw[pick(*layouts)] = pick("BSND", "TND", "PA_BBND", "PA_BSND", "bsnd", "")
    elif kind < 0.16:
        names, values = enums
        kw[pick(*names)] = pick(*values)
    elif kind < 0.2:
        name = pick(*arrays)
        kw[name] = lengths(b, 8, name.startswith("cu"))
    return q, cut


def mla_case():
    layout = pick("BSND", "TND", "TND")
    paged = layout == "BSND" and rng.random() < 0.3
    b, n2 = pick(0, 1, 2, 3), pick(1, 1, 2)
    n1 = n2 * pick(1, 2, 8) if rng.random() < 0.95 else pick(3, 5)
    MUTATED[0] |= n1 % n2 != 0
    d, dtype, ratio = pick(16, 32, 17), pick(*DTYPES), pick(1, 2, 4, 128)
    kw = dict(
        cmp_ratio=ratio,
        ori_mask_mode=pick(0, 3, 4, 4),
        cmp_mask_mode=pick(0, 3, 3),
        softmax_scale=pick(1.0, 0.25, -0.5),
        layout_q=layout,
        layout_kv="PA_BBND" if paged else layout,
    )
    if kw["ori_mask_mode"] == 4:
        kw.update(ori_win_left=pick(-1, 0, 1, 5), ori_win_right=pick(-1, 0, 2))
    if rng.random() < 0.3:
        kw["sinks"] = tensor(n1)
    q_lens, ori_lens = sequence_lengths(b, (0, 1, 5, 30))
    residual = [rng.randrange(ratio) for _ in range(b)]
    cmp_lens = [max(0, (n - r) // ratio) for n, r in zip(ori_lens, residual, strict=True)]
    if layout == "TND":
        q = tensor(sum(q_lens), n1, d, dtype=dtype)
        kw["cu_seqlens_q"] = cumulative(q_lens)
    else:
        q = tensor(b, max(q_lens, default=0), n1, d, dtype=dtype)
        if rng.random() < 0.5 or paged:
            kw["seqused_q"] = q_lens
        else:
            q_lens = [q.shape[1]] * b
    sides = [s for s in ("ori", "cmp") if rng.random() < 0.8] or ["ori"]
    rows_per = q_lens if layout == "TND" else [q.shape[1]] * b
    for side in sides:
        lens = ori_lens if side == "ori" else cmp_lens
        kv, table = key_tensor(kw["layout_kv"], b, lens, n2, d, dtype, pick(1, 4, 16))
        kw[f"{side}_kv"] = kv
        if rng.random() < 0.15:  # a quantized cache (bytes and a scale per row and head)
            kw[f"{side}_kv"], kw[f"{side}_kv_scale"] = quantize(kv, FORMATS[pick("int8", "fp8")])
        if table is not None:
            kw[f"{side}_block_table"] = table
            kw[f"seqused_{side}_kv"] = lens
        elif layout == "TND":
            kw[f"cu_seqlens_{side}_kv"] = cumulative(lens)
        elif rng.random() < 0.5:
            kw[f"seqused_{side}_kv"] = lens
        else:
            lens[:] = [kv.shape[1]] * b
        if rng.random() < 0.3:
            k = pick(1, 3, 8)
            idx = selection(rows_per, lens, n2, k)
            kw[f"{side}_sparse_indices"] = (
                idx if layout == "TND" else idx.view(b, q.shape[1], n2, k)
            )
            if rng.random() < 0.3:
                kw[f"{side}_topk_length"] = torch.randint(
                    0, k + 1, kw[f"{side}_sparse_indices"].shape[:-1], generator=gen
                ).int()
    if "cmp" in sides and kw["cmp_mask_mode"] == 3 and ratio > 1:
        kw["cmp_residual_kv"] = residual
    side = f"{sides[0]}_kv"
    q, kw[side] = mutate(
        q,
        kw[side],
        kw,
        ("layout_q", "layout_kv"),
        (("cmp_ratio", "ori_mask_mode", "cmp_mask_mode"), (0, -1, 2, 2**33)),
        ("cu_seqlens_q", "seqused_q", "cmp_residual_kv", f"seqused_{side}"),
        b,
    )
    if rng.random() < 0.04:
        MUTATED[0] = True
        kw[pick("ori_win_left", "ori_win_right")] = pick(-2, 3, 2**40)
    if rng.random() < 0.4:
        kw["return_softmax_lse"] = True
    return (q,), kw


def by_row(x, layout):
    """An lse ``[B, N2, S1, G]`` / ``[N2, T1, G]`` as the references' ``[rows, N1]``."""
    x = x.permute(1, 0, 2) if layout == "TND" else x.permute(0, 2, 1, 3)
    return x.reshape(-1, x.shape[-2] * x.shape[-1])


def close_or_nan(got, want, tol, finite):
    bad = ~torch.isclose(got.double(), want, atol=tol, rtol=tol, equal_nan=True)
    if not finite:  # a non-finite input may give NaN in the rows it reaches
        bad &= ~got.double().isnan() & ~want.isnan()
    return bad


def check_mla(args, kw, result):
    (q,) = args
    out, lse = result
    ref_kw = {k: (torch.tensor(v) if isinstance(v, list) else v) for k, v in kw.items()}
    ref_kw.pop("return_softmax_lse", None)
    # The rows a quantized cache stands for, as the kernel reads them: dequantized in float32,
    # then rounded to bf16 where bf16 queries run on the bf16 kernels (which a calibration may
    # choose per kind of call, so either way is accepted when the kinds differ).
    quantized = {}
    for side in ("ori", "cmp"):
        if f"{side}_kv_scale" in ref_kw:
            scale = ref_kw.pop(f"{side}_kv_scale")
            quantized[side] = dequantize(ref_kw[f"{side}_kv"], scale, torch.float32)
    pairs = {False}
    if quantized and q.dtype == torch.bfloat16:
        pairs = {choice["pairs"] for choice in opmesh.bf16_kernels().values()}
    errors = []
    for rounded in sorted(pairs):
        for side, rows in quantized.items():
            ref_kw[f"{side}_kv"] = rows.bfloat16() if rounded else rows
        error = mla_differs(q, out, lse, kw, ref_kw)
        if error is None:
            break
        errors.append(error)
    else:
        raise AssertionError(errors[0])
    finite = all(torch.isfinite(t).all() for t in float_tensors(q, ref_kw))
    if finite and not quantized and kw["layout_kv"] != "PA_BBND" and rng.random() < 0.5:
        names = [n for n in ("ori_kv", "cmp_kv", "sinks") if n in kw]
        check_gradients(
            lambda t: opmesh.sparse_flash_mla(
                t[0], **{**kw, **dict(zip(names, t[1:], strict=True))}
            ),
            lambda t: mla_reference(t[0], **{**ref_kw, **dict(zip(names, t[1:], strict=True))}),
            [q] + [kw[n] for n in names],
            lambda out: (
                (out[0], by_row(out[1], kw["layout_q"]))
                if kw.get("return_softmax_lse")
                else (out[0],)
            ),
            GRADIENT_TOL.get(q.dtype, GRADIENT_TOL[torch.float32]),
        )


def float_tensors(q, ref_kw):
    return [q] + [v for v in ref_kw.values() if torch.is_tensor(v) and v.is_floating_point()]


def mla_differs(q, out, lse, kw, ref_kw):
    """Where the output (and the lse, when returned) differ from the reference's, or None."""
    want_out, want_lse = mla_reference(q, **ref_kw)
    finite = all(torch.isfinite(t).all() for t in float_tensors(q, ref_kw))
    tol = 2e-2 if q.dtype != torch.float32 else 2e-4
    bad = close_or_nan(out.reshape(want_out.shape), want_out, tol, finite)
    if bad.any():
        return f"output differs from the reference at {bad.nonzero()[:3].tolist()}"
    if kw.get("return_softmax_lse"):
        bad = close_or_nan(by_row(lse, kw["layout_q"]), want_lse, tol, finite)
        if bad.any():
            return f"lse differs from the reference at {bad.nonzero()[:3].tolist()}"
    return None


# The attention gradient checks' tolerance per query dtype: within 8 x this of the largest
# gradient (at least 1), about what the designed backward tests allow each element (bf16: 3e-2
# absolute plus 3e-2 relative; the upstream, the probabilities and their gradients are rounded to
# bf16 for the products on bf16 pairs; fp16: 5e-3 and 5e-3, 2% here for scales up to 3).
GRADIENT_TOL = {torch.float32: 2e-4, torch.bfloat16: 7.5e-3, torch.float16: 2.5e-3}


def check_gradients(call, reference_call, leaves, outputs, tol):
    """The gradients of `leaves` (float tensors) through `outputs` of the call against those of
    the float64 reference for the same random upstream gradients (the reference's outputs are
    [rows, ...] as `outputs` reshapes the call's): within 8 `tol` of the largest."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    doubles = [t.detach().double().requires_grad_() for t in leaves]
    got = outputs(call(leaves))
    want = reference_call(doubles)[: len(got)]
    # An lse of -inf (no key, no sink) is a constant: no gradient flows from it.
    ups = [
        torch.randn(w.shape, generator=gen, dtype=torch.float64).masked_fill(~w.isfinite(), 0.0)
        for w in want
    ]

    def grads_of(outs, upstream, inputs):
        pairs = [(o, u) for o, u in zip(outs, upstream, strict=True) if o.requires_grad]
        if not pairs:  # nothing reaches the inputs (no row selects a key)
            return [None] * len(inputs)
        outs_, ups_ = zip(*pairs, strict=True)
        return torch.autograd.grad(outs_, inputs, ups_, allow_unused=True)

    captured = Captured()  # the backward kernels' calls, for their shape functions
    with captured:
        upstream = [u.reshape(g.shape).to(g.dtype) for u, g in zip(ups, got, strict=True)]
        mine = grads_of(got, upstream, leaves)
    check_fake(captured.calls)
    refs = grads_of([w.masked_fill(~w.isfinite(), 0.0) for w in want], ups, doubles)
    for i, (a, b) in enumerate(zip(mine, refs, strict=True)):
        a = torch.zeros(leaves[i].shape) if a is None else a.double()
        b = torch.zeros(leaves[i].shape, dtype=torch.float64) if b is None else b
        scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
        if a.numel() and (a - b).abs().max().item() > 8 * tol * scale:
            raise AssertionError(
                f"gradient of input {i} off by {(a - b).abs().max().item():.3g} (scale {scale:.3g})"
            )


def sparse_attention_case():
    layout = pick("BSND", "TND")
    paged = rng.random() < 0.3
    b, n2 = pick(0, 1, 2, 3), pick(1, 1, 2)
    n1 = n2 * pick(1, 2, 8) if rng.random() < 0.95 else pick(3, 5)
    MUTATED[0] |= n1 % n2 != 0
    d, dtype = pick(16, 32, 17), pick(*DTYPES)
    absorb = rng.random() < 0.2
    dv, dr = (d if absorb else pick(d, 8, 24)), pick(0, 0, 8)
    block = pick(1, 1, 2, 16)
    kw = dict(
        layout_query=layout,
        layout_kv="PA_BSND" if paged else layout,
        sparse_mode=pick(0, 3, 3),
        sparse_block_size=block,
    )
    if rng.random() < 0.3:
        kw.update(pre_tokens=pick(UNBOUNDED, 0, 3), next_tokens=pick(UNBOUNDED, 0, 2))
    if rng.random() < 0.2:
        kw["softcap"] = pick(5.0, 30.0)
    if rng.random() < 0.3:
        kw["sinks"] = tensor(n1)
    q_lens, k_lens = sequence_lengths(b, (0, 1, 5, 30))
    rows = (sum(q_lens),) if layout == "TND" else (b, max(q_lens, default=0))
    q = tensor(*rows, n1, d, dtype=dtype)
    if layout == "TND":
        kw["actual_seq_lengths_query"] = cumulative(q_lens)[1:]
    elif rng.random() < 0.5:
        kw["actual_seq_lengths_query"] = q_lens
    key, table = key_tensor(kw["layout_kv"], b, k_lens, n2, d, dtype, pick(1, 4, 16))

    def like_key(width):  # value and key_rope: key's rows (and blocks), their own head dim
        return tensor(*key.shape[:-1], width, dtype=dtype)

    value = key if absorb else like_key(dv)
    if absorb:
        kw["attention_mode"] = 2
    if rng.random() < 0.15:  # a quantized key and value (bytes and a scale per row and head)
        fmt = FORMATS[pick("int8", "fp8")]
        (key, kw["key_scale"]), (value, kw["value_scale"]) = (
            quantize(key, fmt),
            quantize(value, fmt),
        )
        if absorb:  # one tensor serves as both
            value, kw["value_scale"] = key, kw["key_scale"]
    if dr:
        kw.update(query_rope=tensor(*rows, n1, dr, dtype=dtype), key_rope=like_key(dr))
    if table is not None:
        kw.update(block_table=table, actual_seq_lengths_kv=k_lens)
    elif layout == "TND":
        kw["actual_seq_lengths_kv"] = cumulative(k_lens)[1:]
    elif rng.random() < 0.5:
        kw["actual_seq_lengths_kv"] = k_lens
    else:
        k_lens = [key.shape[1]] * b
    rows_per = q_lens if layout == "TND" else [q.shape[1]] * b
    heads = pick(n2, 1)
    k = pick(1, 3, 8)
    idx = selection(rows_per, [-(-n // block) for n in k_lens], heads, k)
    idx = idx if layout == "TND" else idx.view(b, q.shape[1], heads, k)
    q, value = mutate(
        q,
        value,
        kw,
        ("layout_query", "layout_kv"),
        (("sparse_mode", "sparse_block_size", "attention_mode"), (0, -1, 5, 2**33)),
        ("actual_seq_lengths_query", "actual_seq_lengths_kv"),
        b,
    )
    if rng.random() < 0.4:
        kw["return_softmax_lse"] = True
    return (q, key, value, idx, pick(1.0, 0.25, -0.5)), kw


def check_sparse_attention(args, kw, result):
    q, key, value, idx, scale = args
    ref_kw = {k: (torch.tensor(v) if isinstance(v, list) else v) for k, v in kw.items()}
    quantized = "key_scale" in ref_kw
    pairs = {False}
    if quantized:  # the rows the kernel reads (as for sparse_flash_mla's)
        key = dequantize(key, ref_kw.pop("key_scale"), torch.float32)
        value = dequantize(value, ref_kw.pop("value_scale"), torch.float32)
        if q.dtype == torch.bfloat16:
            pairs = {choice["pairs"] for choice in opmesh.bf16_kernels().values()}
    tensors = [q, key, value] + [v for v in ref_kw.values() if isinstance(v, torch.Tensor)]
    finite = all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
    tol = 2e-2 if q.dtype != torch.float32 else 2e-4
    errors = []
    for rounded in sorted(pairs):
        rows = (key.bfloat16(), value.bfloat16()) if rounded else (key, value)
        error = sparse_attention_differs(q, *rows, idx, scale, kw, ref_kw, result, tol, finite)
        if error is None:
            break
        errors.append(error)
    else:
        raise AssertionError(errors[0])
    if quantized:
        return
    if finite and kw["layout_kv"] != "PA_BSND" and rng.random() < 0.5:
        absorb = kw.get("attention_mode") == 2  # value is key: one leaf for both
        names = [n for n in ("query_rope", "key_rope", "sinks") if n in kw]
        lead = 2 if absorb else 3

        def run(fn, t, extra):
            v = t[1] if absorb else t[2]
            return fn(
                t[0], t[1], v, idx, scale, **{**extra, **dict(zip(names, t[lead:], strict=True))}
            )

        check_gradients(
            lambda t: run(opmesh.sparse_flash_attention, t, kw),
            lambda t: run(sparse_attention_reference, t, ref_kw),
            [q, key] + ([] if absorb else [value]) + [kw[n] for n in names],
            lambda out: (out[0],),
            GRADIENT_TOL.get(q.dtype, GRADIENT_TOL[torch.float32]),
        )


def sparse_attention_differs(q, key, value, idx, scale, kw, ref_kw, result, tol, finite):
    """Where the output (and the statistics, when returned) differ from the reference's, or
    None."""
    want_out, want_max, want_sum = sparse_attention_reference(q, key, value, idx, scale, **ref_kw)
    out, smax, ssum = result
    bad = close_or_nan(out.reshape(want_out.shape), want_out, tol, finite)
    if bad.any():
        return f"output differs from the reference at {bad.nonzero()[:3].tolist()}"
    if kw.get("return_softmax_lse"):
        # The statistics as a log-sum-exp: the max alone may sit at either of two tied scores.
        got = by_row(smax, kw["layout_query"]).double() + by_row(ssum, kw["layout_query"]).log()
        bad = close_or_nan(got, want_max + want_sum.log(), tol, finite)
        if bad.any():
            return f"statistics differ at {bad.nonzero()[:3].tolist()}"
    return None


def lightning_indexer_case():
    layout = pick("BSND", "TND")
    paged = rng.random() < 0.3
    b, n2 = pick(0, 1, 2, 3), pick(1, 1, 2)
    n1 = n2 * pick(1, 2, 8) if rng.random() < 0.95 else pick(3, 5)
    MUTATED[0] |= n1 % n2 != 0
    d, dtype, ratio = pick(8, 16, 33), pick(*DTYPES), pick(1, 1, 4, 128)
    kw = dict(
        layout_query=layout,
        layout_key="PA_BSND" if paged else layout,
        sparse_mode=pick(0, 3, 3),
        sparse_count=pick(1, 3, 16, 2048),
        return_value=rng.random() < 0.7,
        cmp_ratio=ratio,
    )
    if ratio == 1 and rng.random() < 0.3:
        kw.update(pre_tokens=pick(UNBOUNDED, 0, 3), next_tokens=pick(UNBOUNDED, 0, 2))
    q_lens, k_lens = sequence_lengths(b, (0, 1, 5, 30))
    if ratio > 1:
        residual = [rng.randrange(ratio) for _ in range(b)]
        k_lens = [max(0, (n - r) // ratio) for n, r in zip(k_lens, residual, strict=True)]
        if kw["sparse_mode"] == 3:
            kw["cmp_residual_key"] = residual
    if layout == "TND":
        q, w = tensor(sum(q_lens), n1, d, dtype=dtype), tensor(sum(q_lens), n1, dtype=dtype)
        kw["actual_seq_lengths_query"] = cumulative(q_lens)[1:]
    else:
        s1 = max(q_lens, default=0)
        q, w = tensor(b, s1, n1, d, dtype=dtype), tensor(b, s1, n1, dtype=dtype)
        if rng.random() < 0.5:
            kw["actual_seq_lengths_query"] = q_lens
    if rng.random() < 0.3:
        w = w.float()
    key, table = key_tensor(kw["layout_key"], b, k_lens, n2, d, dtype, pick(1, 4, 16))
    if table is not None:
        kw.update(block_table=table, actual_seq_lengths_key=k_lens)
    elif layout == "TND":
        kw["actual_seq_lengths_key"] = cumulative(k_lens)[1:]
    elif rng.random() < 0.5:
        kw["actual_seq_lengths_key"] = k_lens
    q, key = mutate(
        q,
        key,
        kw,
        ("layout_query", "layout_key"),
        (("sparse_mode", "sparse_count", "cmp_ratio"), (0, -1, 5, 2**33)),
        ("actual_seq_lengths_query", "actual_seq_lengths_key", "cmp_residual_key"),
        b,
    )
    return (q, key, w), kw


def check_lightning_indexer(args, kw, result):
    """Ties make the order of equal scores the indexer's to choose within rounding, so each row
    is checked by scores: the entries are distinct visible keys, -1 past the visible count, and
    their reference scores match the reference's top scores in order (with a non-finite input,
    whose NaN scores rank in an order rounding decides, only the first two)."""
    ref_kw = {k: (torch.tensor(v) if isinstance(v, list) else v) for k, v in kw.items()}
    scores, visible = lightning_indexer_scores(*args, **ref_kw)
    rows, heads, longest = scores.shape
    count = kw["sparse_count"]
    idx = result[0].reshape(rows, heads, count).long()
    tol = 2e-2 if args[0].dtype != torch.float32 else 2e-4
    finite = all(torch.isfinite(t).all() for t in args)
    for r in range(rows):
        for h in range(heads):
            n = min(count, int(visible[r, h].sum())) if longest else 0
            got = idx[r, h]
            if (got[n:] != -1).any() or (got[:n] < 0).any():
                raise AssertionError(f"row {r} head {h}: {n} visible keys, got {got.tolist()}")
            chosen = got[:n]
            if len(set(chosen.tolist())) != n or not visible[r, h, chosen].all():
                raise AssertionError(f"row {r} head {h}: not distinct visible keys")
            if not finite:
                continue
            top = torch.sort(scores[r, h][visible[r, h]], descending=True).values[:n]
            scale = max(1.0, top.abs().max().item()) if n else 1.0
            if n and (scores[r, h, chosen] - top).abs().max() > 4 * tol * scale:
                raise AssertionError(f"row {r} head {h}: scores of the chosen keys are not the top")
            if kw.get("return_value") and n:
                value = result[1].reshape(rows, heads, count)[r, h, :n].double()
                if (value - scores[r, h, chosen]).abs().max() > 4 * tol * scale:
                    raise AssertionError(f"row {r} head {h}: returned scores differ")


def relaid(t):
    """The same tensor, now and then in another memory layout: non-contiguous, or stride 0 along
    its first dimension (every row then holds the first row's values)."""
    mode = rng.random()
    if mode < 0.05 and t.dim() >= 2 and t.shape[0] > 0:
        return t[:1].expand_as(t)
    if mode > 0.9 and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t


def kl_case(sparse):
    """A KL-loss call: random sequences (S1 above S2 too), GQA on both attentions, rope, masks,
    bands, compressed keys; the main statistics exact or rescaled per head (the target is
    normalised either way), now and then a head without target mass (a log-sum-exp of -inf) in a
    row that sees keys; a NaN or infinity now and then, inputs and statistics alike; for the
    sparse loss a selection of random keys with -1 padding (now and then a bad entry, refused by
    name)."""
    layout = pick("BSND", "TND")
    b, n2, n2i = pick(0, 1, 2, 3), pick(1, 1, 2), pick(1, 1, 2)
    ratio = pick(1, 1, 1, 4)
    q_lens, k_lens = sequence_lengths(b, (0, 1, 5, 30))
    if rng.random() < 0.3:
        k_lens = [rng.randint(0, n) for n in q_lens]
    residuals = None
    if ratio > 1:
        residuals = tuple(rng.randrange(ratio) for _ in range(b))
        k_lens = [max(0, (n - r) // ratio) for n, r in zip(k_lens, residuals, strict=True)]
    if layout == "TND":
        lens = (tuple(cumulative(q_lens)[1:]), tuple(cumulative(k_lens)[1:]))
        s1, s2 = sum(q_lens), sum(k_lens)
    else:
        s1, s2 = max(q_lens, default=0), max(k_lens, default=0)
        lens = (tuple(q_lens), tuple(k_lens)) if rng.random() < 0.6 else None
    case = Case(
        "fuzz",
        layout=layout,
        b=b,
        s1=s1,
        s2=s2,
        n1=n2 * pick(1, 2, 3),
        n2=n2,
        d=pick(1, 5, 16, 33),
        dr=pick(0, 0, 4),
        n1i=n2i * pick(1, 2, 5, 5, 5, 66),
        n2i=n2i,
        di=pick(1, 3, 8, 17),
        lens=lens,
        sparse_mode=pick(0, 3, 3),
        cmp_ratio=ratio,
        residuals=residuals,
    )
    if ratio == 1 and rng.random() < 0.3:
        case = dataclasses.replace(
            case, pre_tokens=pick(UNBOUNDED, 0, 3), next_tokens=pick(UNBOUNDED, 0, 2)
        )
    dtype = pick(*DTYPES, torch.float64) if rng.random() < 0.2 else pick(*DTYPES)
    t, scale, kw = kl_make(case, dtype, rng.randrange(2**20))
    # A row that sees no key has statistics (-inf, 0); flash_attn's lse with ones, or any
    # finite ones, serve as well.
    if rng.random() < 0.5:
        t["softmax_sum"] = t["softmax_sum"].masked_fill(t["softmax_sum"] == 0, 1.0)
    if rng.random() < 0.3:
        t["softmax_max"] = t["softmax_max"].nan_to_num(neginf=0.0)
    if rng.random() < 0.3:
        group = case.n1 // case.n2
        t["softmax_sum"] = t["softmax_sum"] * (1 + 2 * torch.rand(group, generator=gen))
    if rng.random() < 0.1 and t["softmax_max"].numel():  # a head without target mass
        at, kind = rng.randrange(t["softmax_max"].numel()), rng.randrange(3)
        if kind != 1:
            t["softmax_max"].view(-1)[at] = -math.inf
        if kind != 0:
            t["softmax_sum"].view(-1)[at] = 0.0
    if rng.random() < 0.07:
        name = pick("query", "key", "query_index", "key_index", "weights", "softmax_max",
                    "softmax_sum", "query_rope")  # fmt: skip
        if t.get(name) is not None and t[name].numel():
            t[name].view(-1)[rng.randrange(t[name].numel())] = pick(math.nan, math.inf, -math.inf)
    t = {name: relaid(x) for name, x in t.items()}
    idx = None
    if sparse:
        k = pick(1, 3, 8, 40)
        idx = kl_selection(
            case, k, shared=rng.random() < 0.3, seed=rng.randrange(2**20), fill=pick(0.3, 0.6, 1.0)
        )
        if rng.random() < 0.05 and idx.numel() >= 2:
            MUTATED[0] = True
            flat = idx.view(-1)
            flat[rng.randrange(idx.numel())] = pick(s2 + 5, -2, int(flat[0]))
        if rng.random() < 0.3:
            idx = idx.long()
    lead = (case.s1,) if layout == "TND" else (case.b, case.s1)
    KL_STATS["index"] = tuple(
        torch.full((*lead[:-1], case.n2i, lead[-1]), v, dtype=torch.float32) for v in (0.0, 1.0)
    )
    t["query_index"], t["key_index"] = mutate(
        t["query_index"],
        t["key_index"],
        kw,
        ("layout",),
        (("sparse_mode", "cmp_ratio", "pre_tokens"), (0, -1, 2, 2**33)),
        ("actual_seq_qlen", "actual_seq_klen", "cmp_residual_key"),
        b,
    )
    kind = rng.random()
    MUTATED[0] |= kind < 0.07
    if kind < 0.03:
        name = pick("softmax_max", "softmax_sum", "weights")
        t[name] = t[name][..., :-1] if t[name].shape[-1] > 1 else t[name][None]
    elif kind < 0.05:
        scale = pick(math.nan, math.inf)
    elif kind < 0.07:
        t["key"] = t["key"].detach().requires_grad_()  # the target takes no gradient
    return (t, idx, scale), kw


# The index statistics a dense KL call passes when the softmax_lse op refuses the arguments (so
# that the loss operator's own checks meet them): zeros and ones of the unmutated case's shape.
KL_STATS = {}


def kl_call(args, kw):
    t, idx, scale = args
    ropes = dict(query_rope=t.get("query_rope"), key_rope=t.get("key_rope"))
    if idx is not None:
        return opmesh.sparse_lightning_indexer_grad_kl_loss(
            t["query"],
            t["key"],
            t["query_index"],
            t["key_index"],
            t["weights"],
            idx,
            t["softmax_max"],
            t["softmax_sum"],
            scale,
            **ropes,
            **kw,
        )
    try:
        stats = opmesh.dense_lightning_indexer_softmax_lse(
            t["query_index"], t["key_index"], t["weights"], **kw
        )
    except (ValueError, TypeError, RuntimeError):
        stats = KL_STATS["index"]
    return opmesh.dense_lightning_indexer_grad_kl_loss(
        t["query"],
        t["key"],
        t["query_index"],
        t["key_index"],
        t["weights"],
        t["softmax_max"],
        t["softmax_sum"],
        *stats,
        scale,
        **ropes,
        **kw,
    )


def beyond(got, want, allowed, finite):
    """Where ``got`` is further than ``allowed`` from ``want`` (NaN where the other is NaN; with
    a non-finite input, NaN on either side), as a bool tensor."""
    got = got.double()
    bad = ((got - want).abs() > allowed) | (got.isnan() != want.isnan())
    bad &= ~(got.isnan() & want.isnan()) & ~((got == want) & got.isinf())
    if not finite:
        bad &= ~got.isnan() & ~want.isnan()
    return bad


def natural_scales(case, query_index, key_index, weights):
    """A bound on the size of each gradient's terms, for the case where every gradient is small
    (rows that see one key have dI = 0 but for float32 rounding, about 1e-7 of these terms):
    |dI| <= 1 with relu(S) <= |query_index row| |key_index row|, the weights and index rows at
    most their largest entries, and d_key_index summing a sequence's rows and a group's heads."""
    qi, ki, w = (x.double().nan_to_num(0.0, 0.0, 0.0) for x in (query_index, key_index, weights))

    def largest(x):
        return x.abs().max().item() if x.numel() else 0.0

    rows = max((n for _, n, _, _ in kl_sequences(case)), default=0)
    group = case.n1i // max(case.n2i, 1)
    return (
        largest(w) * largest(ki),
        largest(w) * largest(qi) * math.sqrt(max(1, rows * group)),
        largest(qi.norm(dim=-1)) * largest(ki.norm(dim=-1)),
    )


def kl_rows(case, like, keys):
    """A bool mask of ``like``'s rows (query rows, or key rows with ``keys``) of the sequences
    that have both queries and keys: the rows a KL call reads and writes."""
    mask = torch.zeros(like.shape, dtype=torch.bool)
    for b, (q0, ql, k0, kl) in enumerate(kl_sequences(case)):
        if ql and kl:
            begin, n = (k0, kl) if keys else (q0, ql)
            mask[(() if case.layout == "TND" else (b,)) + (slice(begin, begin + n),)] = True
    return mask


def kl_reads_non_finite(case, t):
    """The operators' rule: a NaN or an infinity in a row the call reads, a statistic's max of
    -inf (a head without target mass) aside."""
    for name, x in t.items():
        if name.startswith("softmax"):
            rows = kl_rows(case, x.movedim(-2, -3) if case.layout == "BSND" else x.movedim(1, 0),
                           False)  # fmt: skip
            rows = rows.movedim(-3, -2) if case.layout == "BSND" else rows.movedim(0, 1)
            bad = x.isnan() | (x == math.inf) | ((x == -math.inf) & (name == "softmax_sum"))
        else:
            rows = kl_rows(case, x, name.startswith("key"))
            bad = ~x.isfinite()
        if (bad & rows).any():
            return True
    return False


def as_ints(v):
    return None if v is None else tuple(int(x) for x in (v.tolist() if torch.is_tensor(v) else v))


def check_kl(args, kw, result):
    """Loss and gradients against float64 autograd of the formula, for the case the call's own
    arguments describe; a third of the finite calls also through the differentiable front,
    which must give the same loss and gradients."""
    t, idx, scale = args
    layout, q, k = kw["layout"], t["query"], t["key"]
    qlen, klen = as_ints(kw.get("actual_seq_qlen")), as_ints(kw.get("actual_seq_klen"))
    if layout == "TND":
        b, lens = len(qlen), (qlen, klen)
    else:
        b = q.shape[0]
        lens = (
            None
            if qlen is None and klen is None
            else (qlen or (q.shape[1],) * b, klen or (k.shape[1],) * b)
        )
    case = Case(
        "fuzz",
        layout=layout,
        b=b,
        s1=q.shape[-3],
        s2=k.shape[-3],
        n1=q.shape[-2],
        n2=k.shape[-2],
        d=q.shape[-1],
        dr=t["query_rope"].shape[-1] if "query_rope" in t else 0,
        n1i=t["query_index"].shape[-2],
        n2i=t["key_index"].shape[-2],
        di=t["query_index"].shape[-1],
        lens=lens,
        sparse_mode=kw["sparse_mode"],
        pre_tokens=kw["pre_tokens"],
        next_tokens=kw["next_tokens"],
        cmp_ratio=kw.get("cmp_ratio", 1),
        residuals=as_ints(kw.get("cmp_residual_key")),
    )
    if idx is None:
        want_loss, want = dense_kl_reference(case, t, scale)
    else:
        want_loss, want = sparse_kl_reference(case, t, idx, scale)
    *grads, loss = result
    if loss.shape != (1,) or loss.dtype != torch.float32:
        raise AssertionError(f"loss of shape {tuple(loss.shape)} and {loss.dtype}")
    inputs = [t[n] for n in ("query_index", "key_index", "weights")]
    if kl_reads_non_finite(case, t):  # documented: a NaN loss, every written row NaN
        if not loss.isnan().all():
            raise AssertionError(f"a non-finite input read, and a loss of {loss.item()}")
        for name, got, keys in zip(("d_query_index", "d_key_index", "d_weights"), grads,
                                   (False, True, False), strict=True):  # fmt: skip
            rows = kl_rows(case, got, keys)
            if not (got[rows].isnan().all() and (got[~rows] == 0).all()):
                raise AssertionError(f"{name}: not NaN in the rows read, zero elsewhere")
        return
    finite = True  # any non-finite value lies outside the rows read
    if beyond(loss[0], want_loss, 1e-5 + 2e-5 * want_loss.abs(), finite):
        raise AssertionError(f"loss {loss.item()}, expected {want_loss.item()}")
    for name, got, ref, like, floor in zip(
        ("d_query_index", "d_key_index", "d_weights"),
        grads,
        want,
        inputs,
        natural_scales(case, *inputs),
        strict=True,
    ):
        if got.dtype != like.dtype or got.shape != like.shape:
            raise AssertionError(f"{name}: {got.dtype} {tuple(got.shape)} for {like.dtype}")
        rel, out_rtol = KL_TOLERANCES.get(like.dtype, KL_TOLERANCES[torch.float32])
        largest = max(
            ref[ref.isfinite()].abs().max().item() if ref.isfinite().any() else 0.0, floor
        )
        bad = beyond(got, ref, rel * largest + out_rtol * ref.abs(), finite)
        if bad.any():
            raise AssertionError(
                f"{name} differs from the reference at {bad.nonzero()[:3].tolist()}: "
                f"{got[bad][:3].tolist()} for {ref[bad][:3].tolist()}"
            )
    if finite and rng.random() < 0.35:
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        ropes = dict(query_rope=t.get("query_rope"), key_rope=t.get("key_rope"))
        if idx is None:
            front = opmesh.indexer_kl_loss(
                *leaves, q, k, t["softmax_max"], t["softmax_sum"], scale, **ropes, **kw
            )
        else:
            front = opmesh.sparse_indexer_kl_loss(
                *leaves, q, k, idx, t["softmax_max"], t["softmax_sum"], scale, **ropes, **kw
            )
        front.sum().backward()
        if not torch.equal(front.detach(), loss):
            raise AssertionError(f"the front's loss {front.item()} is not the operator's")
        for name, leaf, got in zip(
            ("query_index", "key_index", "weights"), leaves, grads, strict=True
        ):
            if leaf.grad is None or not torch.equal(leaf.grad, got):
                raise AssertionError(f"the front's gradient of {name} is not the operator's")


# The state cache as a compressor case made it, before the call writes it.
BEFORE = {}


def plain(*shape, dtype=torch.float32):
    """Random values (a NaN now and then), no stride-0 or infinite ones: the compressor's result
    is compared with the reference's, NaN for NaN."""
    t = torch.randn(*shape, generator=gen).to(dtype)
    if rng.random() < 0.05 and t.numel():
        t.view(-1)[rng.randrange(t.numel())] = math.nan
    return t


def compressor_case():
    """A valid call (BSND and TND, empty sequences, seqused, a continuous or ring state cache read
    and written from any start_pos, block 0 where nothing is read, given projections), then, one
    call in four, one mutation."""
    b, coff, r = pick(0, 1, 2, 3), pick(1, 2), pick(1, 2, 3, 4, 5)
    d, h, dtype = pick(1, 4, 7), pick(1, 5, 9), pick(*DTYPES, torch.float64)
    width = coff * d
    kw = dict(coff=coff)
    if rng.random() < 0.4:
        rows = [rng.randint(0, 9) for _ in range(b)]
        kw["cu_seqlens"] = cumulative(rows)
        x = plain(sum(rows), h, dtype=dtype)
    else:
        rows = [pick(0, 1, 3, 8, 13)] * b if b else []
        x = plain(b, rows[0] if b else pick(0, 5), h, dtype=dtype)
    x = relaid(x)
    wkv, wgate = relaid(plain(width, h, dtype=dtype)), relaid(plain(width, h, dtype=dtype))
    ape = relaid(plain(r, width, dtype=pick(dtype, torch.float32, torch.float64)))
    used = rows
    if rng.random() < 0.3:
        used = [rng.randint(0, n) for n in rows]
        kw["seqused"] = used
    state = None
    if rng.random() < 0.6:
        mode, blocks = pick(1, 2), pick(2, 3, 8, 40)
        bs = pick(1, 2, 4, 8, 16) if mode == 1 else pick(coff * r, coff * r + 1, 16, 32)
        state = plain(blocks, bs, 2 * width)
        starts = [pick(0, rng.randint(0, 12)) for _ in range(b)]

        def reads(i):  # the positions sequence i reads from the state: [lo, start)
            first, last = starts[i] // r, (starts[i] + used[i]) // r
            return max(0, (first - (coff - 1)) * r) if last > first else starts[i], starts[i]

        def block(keep):  # block 0 (none) now and then, where nothing is read
            return 0 if not keep and rng.random() < 0.1 else rng.randint(1, blocks - 1)

        if mode == 1:
            cols = max([(s + n - 1) // bs + 1 for s, n in zip(starts, used, strict=True)] + [1])
            cols += pick(0, 0, 1)
            table = []
            for i in range(b):
                lo, hi = reads(i)
                need = {p // bs for p in range(lo, hi)}
                table.append([block(c in need) for c in range(cols)])
        else:
            table = [block(reads(i)[0] < reads(i)[1]) for i in range(b)]
        if rng.random() < 0.5:  # a tensor ([0, cols] for no sequences), or the lists
            table = torch.tensor(table, dtype=pick(torch.int32, torch.int64))
            table = table.reshape(0, cols) if mode == 1 and b == 0 else table
        kw.update(state_block_table=table, cache_mode=mode, start_pos=starts)
    elif rng.random() < 0.2:
        kw["start_pos"] = [0] * b
    if rng.random() < 0.2:
        kw["projections"] = plain(*x.shape[:-1], 2 * width)
    kind = rng.random()
    MUTATED[0] = kind < 0.25
    if kind < 0.02:
        x = x.int() if rng.random() < 0.5 else x[..., :-1] if h > 1 else x.unsqueeze(0)
    elif kind < 0.04:
        wkv = plain(width + 1, h, dtype=dtype)
    elif kind < 0.06:
        wgate = wgate.double() if dtype != torch.float64 else wgate.float()
    elif kind < 0.08:
        ape = plain(r + pick(-1, 1), width)
    elif kind < 0.10:
        kw[pick("coff", "cache_mode")] = pick(0, 3, -1)
    elif kind < 0.11:
        r = pick(0, -1)
    elif kind < 0.14:
        name = pick("cu_seqlens", "seqused", "start_pos")
        kw[name] = lengths(b, 9, name.startswith("cu"))
    elif kind < 0.17 and state is not None:
        state = pick(state.double(), state.transpose(1, 2), state[:, :0], state[..., :-1])
    elif kind < 0.20 and state is not None:
        table = kw["state_block_table"]
        table = torch.as_tensor(table, dtype=torch.int64).clone()
        if table.numel():
            table.view(-1)[rng.randrange(table.numel())] = pick(-1, 0, state.shape[0], 2**40)
        kw["state_block_table"] = pick(table, table[:, :1] if table.dim() == 2 else table[:0])
    elif kind < 0.22 and state is not None:
        kw["cache_mode"] = 3 - kw["cache_mode"]
    elif kind < 0.25 and "projections" in kw:
        t = kw["projections"]
        kw["projections"] = pick(t.double(), t[..., :-1] if t.shape[-1] > 1 else t[..., :0], x)
    BEFORE["state"] = None if state is None else state.clone()
    if "projections" in kw:
        BEFORE["projections"] = kw["projections"].clone()
    return (x, wkv, wgate, state, ape, r), kw


def check_compressor(args, kw, result):
    x, wkv, wgate, state, ape, r = args
    plain_kw = {k: v for k, v in kw.items() if k != "projections"}
    want, want_state = compressor_reference(x, wkv, wgate, BEFORE["state"], ape, r, **plain_kw)
    tol = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
    tol = tol[x.dtype]
    if result.shape != want.shape:
        raise AssertionError(f"shape {tuple(result.shape)}, expected {tuple(want.shape)}")
    if not torch.allclose(result.double(), want, atol=tol, rtol=tol, equal_nan=True):
        raise AssertionError(f"cmp_kv off by {(result.double() - want).abs().max().item()}")
    if state is not None and not torch.allclose(state.double(), want_state, atol=1e-4,
                                                rtol=1e-4, equal_nan=True):  # fmt: skip
        raise AssertionError("state_cache written wrong")
    if "projections" in kw:
        check_projections(x, wkv, wgate, ape, r, kw)
    # Training: without a state cache the gradients of x, wkv, wgate and ape (half the finite
    # calls) against the reference's autograd.
    leaves = [x, wkv, wgate, ape]
    if state is None and all(t.isfinite().all() for t in leaves) and rng.random() < 0.5:
        check_gradients(
            lambda t: (opmesh.compressor(t[0], t[1], t[2], None, t[3], r, **plain_kw),),
            lambda t: compressor_reference(t[0], t[1], t[2], None, t[3], r, **plain_kw)[:1],
            leaves,
            lambda out: out,
            {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 4e-3, torch.float16: 1e-3}[
                x.dtype
            ],  # fmt: skip
        )


def check_projections(x, wkv, wgate, ape, r, kw):
    """Each used token's row of `projections` holds its [kv | score + ape] (float32); the other
    rows keep their bits."""
    got, want = kw["projections"], BEFORE["projections"].double()
    packed = x.dim() == 2
    cu = kw.get("cu_seqlens")
    for b in range(len(cu) - 1 if packed else x.shape[0]):
        rows = x[cu[b] : cu[b + 1]] if packed else x[b]
        used = kw["seqused"][b] if "seqused" in kw else rows.shape[0]
        start = kw["start_pos"][b] if "start_pos" in kw else 0
        tok = rows[:used].double()
        pos = torch.arange(start, start + used)
        row = torch.cat([tok @ wkv.double().T, tok @ wgate.double().T + ape.double()[pos % r]], 1)
        if packed:
            want[cu[b] : cu[b] + used] = row
        else:
            want[b, :used] = row
    scale = max(1.0, want.nan_to_num(0.0).abs().max().item()) if want.numel() else 1.0
    if not torch.allclose(got.double(), want, atol=1e-4 * scale, rtol=1e-4, equal_nan=True):
        raise AssertionError("projections written wrong")


CASES = {
    "compressor": (
        compressor_case,
        lambda a, kw: opmesh.compressor(*a, **kw),
        check_compressor,
    ),
    "flash_attn": (flash_attn_case, lambda a, kw: opmesh.flash_attn(*a, **kw), check_flash_attn),
    "flash_attn_metadata": (
        metadata_case,
        lambda a, kw: opmesh.flash_attn_metadata(*a, **kw),
        check_metadata,
    ),
    "indexer": (
        indexer_case,
        lambda a, kw: opmesh.dense_lightning_indexer_softmax_lse(*a, **kw),
        check_indexer,
    ),
    "kv_cache_write_": (kv_case, lambda a, kw: opmesh.kv_cache_write_(*a, **kw), check_kv),
    "sparse_flash_mla": (mla_case, lambda a, kw: opmesh.sparse_flash_mla(*a, **kw), check_mla),
    "sparse_flash_attention": (
        sparse_attention_case,
        lambda a, kw: opmesh.sparse_flash_attention(*a, **kw),
        check_sparse_attention,
    ),
    "lightning_indexer": (
        lightning_indexer_case,
        lambda a, kw: opmesh.lightning_indexer(*a, **kw),
        check_lightning_indexer,
    ),
    "describe_metadata": (describe_case, lambda a, kw: opmesh.describe_metadata(*a), None),
    "dense_lightning_indexer_grad_kl_loss": (lambda: kl_case(False), kl_call, check_kl),
    "sparse_lightning_indexer_grad_kl_loss": (lambda: kl_case(True), kl_call, check_kl),
}


class Captured(TorchDispatchMode):
    """The opmesh operator calls below autograd (the kernels' own), with their results."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "opmesh":
            self.calls.append((func, args, kwargs, out))
        return out


def concrete(n):
    """A size as an int: a symbolic one (fake tensors' sizes are symbols) by its value; None for a
    data-dependent (unbacked) one."""
    try:
        return int(n)
    except Exception:  # noqa: BLE001
        return None


def layout_of(t):
    """Shape, dtype and the strides of the dimensions longer than 1 (the others say nothing)."""
    shape = tuple(concrete(n) for n in t.shape)
    if any(n is None for n in shape):
        return shape, t.dtype, ()
    strides = tuple(concrete(st) for n, st in zip(shape, t.stride(), strict=True) if n > 1)
    return shape, t.dtype, strides if math.prod(shape) > 1 else ()


def check_fake(calls):
    """Each kernel call again on fake tensors of the same shapes, dtypes and strides: the shape
    function torch.compile and export trace with accepts it and gives the results' shapes, dtypes
    and strides (a data-dependent size aside). A miss here is a graph that fails to trace a call
    that runs eagerly, or one that lays out its results otherwise than the kernel does."""
    for func, args, kwargs, out in calls:
        # Sizes as symbols (what a dynamic graph traces with) or as ints, half the time each.
        static = rng.random() < 0.5
        with FakeTensorMode(shape_env=ShapeEnv()) as mode:
            fargs, fkwargs = pytree.tree_map_only(
                torch.Tensor,
                lambda t, m=mode, st=static: m.from_tensor(t, static_shapes=st),
                (args, kwargs),
            )
            try:
                got = func(*fargs, **fkwargs)
            except Exception as e:  # noqa: BLE001
                raise AssertionError(
                    f"{func}: the shape function refused: {str(e)[:200]}"
                ) from None
        want = [layout_of(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        have = [layout_of(t) for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
        match = len(want) == len(have) and all(
            w[1] == h[1] and all(a == b or b is None for a, b in zip(w[0], h[0], strict=True))
            and (not h[2] or w[2] == h[2])
            for w, h in zip(want, have, strict=True)
        )  # fmt: skip
        if not match:
            raise AssertionError(f"{func}: the shape function gives {have}, the kernel {want}")


def seed_case(i):
    # Each case from its own seed, so that CASE i alone is the same call whatever ran before.
    rng.seed(f"{seed}-{i}")
    gen.manual_seed(seed * 1_000_003 + i)
    MUTATED[0] = False


def flash_attn_plan(args, kw, workers):
    """flash_attn_metadata(deterministic=True) for the flash_attn call (args, kw)."""
    q, k, v = args
    lq, lkv = kw["layout_q"], kw["layout_kv"]
    head = 1 if lq == "BNSD" else -2
    plan = {n: kw[n] for n in PLANNED if n in kw}
    if lq == "TND":
        cu_q, cu_k = (torch.as_tensor(kw[n]).tolist() for n in ("cu_seqlens_q", "cu_seqlens_kv"))
        batch = len(cu_q) - 1
        longest_q = max([b - a for a, b in zip(cu_q, cu_q[1:], strict=False)] or [0])
        longest_k = max([b - a for a, b in zip(cu_k, cu_k[1:], strict=False)] or [0])
    else:
        batch, longest_q = q.shape[0], q.shape[2 if lq == "BNSD" else 1]
        if lkv == "PA_BBND":
            longest_k = kw["block_table"].shape[1] * k.shape[1]
        else:
            longest_k = k.shape[2 if lkv == "BNSD" else 1]
    plan.setdefault("max_seqlen_q", longest_q)
    plan.setdefault("max_seqlen_kv", longest_k)
    return opmesh.flash_attn_metadata(
        q.shape[head], k.shape[1 if lkv == "BNSD" else -2], q.shape[-1], head_dim_v=v.shape[-1],
        batch_size=batch, num_workers=workers, deterministic=True, **plan,
    )  # fmt: skip


PLANNED = ["cu_seqlens_q", "cu_seqlens_kv", "seqused_q", "seqused_kv", "max_seqlen_q"]
PLANNED += ["max_seqlen_kv", "mask_mode", "win_left", "win_right", "layout_q", "layout_kv"]
PLANNED += ["layout_out"]


def check_threads(i):
    """The same call (made again from the case's seed) on 1, 2 and 3 threads gives the same bits:
    its results and whatever it writes in place. `flash_attn`'s forward is asked for its
    deterministic mode, the one that promises this (by default a split unit's pieces are merged
    in an order that follows the worker count); `flash_attn_metadata`'s plans follow the thread
    count by design."""
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            seed_case(i)
            args, kw = make()
            if op_name == "flash_attn":  # a deterministic plan for 1, 2 and 16 workers
                kw["metadata"] = flash_attn_plan(args, kw, n if n < 3 else 16)
            out = call(args, kw)
            kw.pop("metadata", None)  # the plans differ; what they give must not
            leaves = pytree.tree_leaves((out, args, kw))
            runs.append([t for t in leaves if isinstance(t, torch.Tensor)])
    finally:
        torch.set_num_threads(threads)
    for n, run in zip((2, 3), runs[1:], strict=True):
        for j, (a, b) in enumerate(zip(runs[0], run, strict=True)):
            if a.device.type != "meta" and not torch.equal(bits(a), bits(b)):
                raise AssertionError(f"tensor {j} differs on {n} threads from 1")


make, call, check = CASES[op_name]
results = {"ok": 0, "refused": 0, "bad": []}
only = int(argv[3]) if len(argv) > 3 else None


def compiled_call(args, kw, dynamic):
    """The call through torch.compile: tensors are the graph's inputs, the rest constants."""
    tensors = {k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}
    constants = {k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)}

    def fn(args, tensors):
        return call(args, {**constants, **tensors})

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=dynamic)(args, tensors)


for i in range(count):
    if only is not None and i != only:
        continue
    seed_case(i)
    args, kw = make()
    if COMPILED:
        if MUTATED[0]:
            continue
        print(f"CASE {i}", flush=True)
        try:
            result = compiled_call(args, kw, dynamic=i % 2 == 1)
            check(args, kw, result)
        except Exception as e:  # noqa: BLE001
            results["bad"].append(f"case {i} compiled: {type(e).__name__}: {str(e)[:300]}")
            continue
        results["ok"] += 1
        continue
    print(f"CASE {i}", flush=True)
    if only is not None:
        print(
            [
                (tuple(a.shape), a.dtype, a.stride()) if isinstance(a, torch.Tensor) else a
                for a in args
            ],
            kw,
        )
    captured = Captured()
    try:
        with captured:
            result = call(args, kw)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        message = str(e)
        name = message.split(":", 1)[0].split(",")[0].strip()
        if name not in ARGUMENTS and name != op_name:
            results["bad"].append(
                f"case {i}: {type(e).__name__} names no argument: {message[:300]}"
            )
        elif op_name in STRICT and not MUTATED[0]:
            results["bad"].append(f"case {i}: a valid call was refused: {message[:300]}")
        else:
            results["refused"] += 1
        continue
    except Exception as e:  # noqa: BLE001
        results["bad"].append(f"case {i}: unexpected {type(e).__name__}: {str(e)[:300]}")
        continue
    if check is not None:
        try:
            check_fake(captured.calls)
            check(args, kw, result)
            if op_name != "flash_attn_metadata" and not MUTATED[0] and rng.random() < 0.25:
                check_threads(i)
        except AssertionError as e:
            results["bad"].append(
                f"case {i}: wrong result: {e}; "
                f"kw={ {k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)} }"
            )
            continue
    results["ok"] += 1
print("RESULT " + json.dumps(results), flush=True)
