"""The child process of test_fuzz.py: ``python fuzz_child.py OP SEED COUNT [CASE]``.

Generates COUNT seeded cases for OP, runs each, and prints ``CASE i`` before each call (so a
crash can be traced to its case) and one ``RESULT {json}`` line at the end: how many calls gave
a correct result, how many were refused by name, and every case that did neither. With CASE,
runs that case alone and prints its arguments.
"""

import json
import math
import random
import sys

import torch
from attention_reference import flash_attn_reference
from reference import compressor as compressor_reference
from reference import indexer_softmax_lse

import opmesh

op_name, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
gen = torch.Generator().manual_seed(seed)
torch.set_num_threads(rng.choice([1, 2]))

ARGUMENTS = {
    "flash_attn": [
        "q",
        "k",
        "v",
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
        "batch",
    ],
    "kv_cache_write_": ["key", "value", "key_cache", "value_cache", "slot_mapping"],
    "describe_metadata": ["metadata"],
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
    layout = pick("BSND", "BNSD", "TND", "TND")
    paged = layout != "TND" and rng.random() < 0.25
    b, s1, s2 = pick(0, 1, 2, 3), size(), size()
    nkv = pick(1, 2, 3)
    nq = nkv * pick(1, 2, 4) if rng.random() < 0.9 else pick(1, 5, 7)
    d, dv = pick(8, 16, 17, 64), pick(8, 16, 24)
    dtype = pick(*DTYPES)
    kw = dict(mask_mode=pick(0, 3, 4, 4, 1, -1, 2**32 + 3))
    if kw["mask_mode"] == 4 or rng.random() < 0.05:
        kw["win_left"] = pick(-1, 0, 1, 5, 2**31, 2**63 - 1, -2)
        kw["win_right"] = pick(-1, 0, 2, 2**40, -(2**62))
    if rng.random() < 0.2:
        kw["sinks"] = tensor(nq if rng.random() < 0.9 else nq + 1)
    if rng.random() < 0.1:
        kw["softmax_scale"] = pick(0.0, 1e-3, 1e39, -0.5)
    if layout == "TND":
        cu_q = lengths(b, s1, True)
        cu_k = lengths(b, s2, True)
        tq, tk = total(cu_q, s1), total(cu_k, s2)
        q = tensor(tq, nq, d, dtype=dtype)
        k = tensor(tk, nkv, d, dtype=dtype)
        v = tensor(tk, nkv, dv, dtype=dtype)
        kw.update(
            cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, layout_q="TND", layout_kv="TND", layout_out="TND"
        )
    else:
        q = (
            tensor(b, s1, nq, d, dtype=dtype)
            if layout == "BSND"
            else tensor(b, nq, s1, d, dtype=dtype)
        )
        kw.update(layout_q=layout, layout_out=pick(layout, "BSND", "BNSD"))
        if paged:
            bs = pick(1, 4, 16)
            blocks = pick(1, 3, 8)
            k = tensor(blocks, bs, nkv, d, dtype=dtype)
            v = tensor(blocks, bs, nkv, dv, dtype=dtype)
            per_seq = pick(1, 2, 4)
            table = torch.randint(-1, blocks + 1, (b, per_seq), generator=gen, dtype=torch.int32)
            if rng.random() < 0.8:
                table = table.clamp(0, blocks - 1)
            kw.update(
                layout_kv="PA_BBND", block_table=table, seqused_kv=lengths(b, bs * per_seq, False)
            )
        else:
            kw["layout_kv"] = layout
            k = (
                tensor(b, s2, nkv, d, dtype=dtype)
                if layout == "BSND"
                else tensor(b, nkv, s2, d, dtype=dtype)
            )
            v = (
                tensor(b, s2, nkv, dv, dtype=dtype)
                if layout == "BSND"
                else tensor(b, nkv, s2, dv, dtype=dtype)
            )
        if rng.random() < 0.3:
            kw["seqused_q"] = lengths(b, s1, False)
    mutate = rng.random()
    if mutate < 0.05:
        q = q.double() if rng.random() < 0.5 else q.int()
    elif mutate < 0.1:
        k = k[..., :-1] if k.shape[-1] > 1 else k
    elif mutate < 0.15:
        kw[pick("layout_q", "layout_kv", "layout_out")] = pick("BSND", "TND", "PA_BBND", "bsnd", "")
    elif mutate < 0.2:
        q = q.unsqueeze(0)
    elif mutate < 0.25:
        kw["max_seqlen_q"] = pick(-1, 0, 3, 2**40)
    if rng.random() < 0.3 and isinstance(q, torch.Tensor):
        kw["return_softmax_lse"] = True
    return (q, k, v), kw


def check_flash_attn(args, kw, result):
    q, k, v = args
    out, lse = result
    ref_kw = {key: (torch.tensor(val) if isinstance(val, list) else val) for key, val in kw.items()}
    if ref_kw.get("mask_mode") == 4:
        for side in ("win_left", "win_right"):
            if ref_kw.get(side, -1) >= 2**31 - 256:
                ref_kw[side] = -1
    ref_out, ref_lse = flash_attn_reference(q.float(), k.float(), v.float(), **ref_kw)
    tol = 2e-2 if q.dtype != torch.float32 else 2e-4
    finite = all(torch.isfinite(t).all() for t in (q, k, v))

    def differs(got, want):
        bad = ~torch.isclose(got.double(), want, atol=tol, rtol=tol, equal_nan=True)
        if not finite:
            # Documented: a non-finite input reaches the rows it touches as NaN (for a key or
            # value: every row of the query tiles that load its key tile, 0 * inf), in the output
            # and in the lse alike (where the reference's logsumexp of an infinite score is inf).
            bad &= ~got.double().isnan() & ~want.isnan()
        return bad

    bad = differs(out, ref_out)
    if bad.any():
        raise AssertionError(f"output differs from the reference at {bad.nonzero()[:3].tolist()}")
    if kw.get("return_softmax_lse"):
        bad = differs(lse, ref_lse)
        if bad.any():
            raise AssertionError(f"lse differs from the reference at {bad.nonzero()[:3].tolist()}")


def metadata_case():
    # A valid call, then (most of the time) one mutation.
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
    if rng.random() < 0.7:
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


def indexer_case():
    layout = pick("BSND", "TND", "BNSD")
    b, s1, s2 = pick(0, 1, 2), size(), size()
    n2 = pick(1, 2)
    n1 = n2 * pick(1, 3) if rng.random() < 0.9 else 3
    d = pick(1, 16, 33, 2049)
    dtype = pick(*DTYPES)
    kw = dict(layout=layout, sparse_mode=pick(0, 3, 3, 1, 2**32 + 3))
    if layout == "TND":
        ends_q = lengths(b, s1, True)[1:] if rng.random() < 0.9 else lengths(b, s1, False)
        ends_k = lengths(b, s2, True)[1:]
        tq, tk = total(ends_q, s1), total(ends_k, s2)
        args = (tensor(tq, n1, d, dtype=dtype), tensor(tk, n2, d, dtype=dtype), tensor(tq, n1))
        kw.update(actual_seq_qlen=ends_q, actual_seq_klen=ends_k)
    else:
        args = (
            tensor(b, s1, n1, d, dtype=dtype),
            tensor(b, s2, n2, d, dtype=dtype),
            tensor(b, s1, n1),
        )
        if rng.random() < 0.4:
            kw["actual_seq_qlen"] = lengths(b, s1, False)
        if rng.random() < 0.4:
            kw["actual_seq_klen"] = lengths(b, s2, False)
    if rng.random() < 0.05:
        args = (args[0], args[1], args[2].double())
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
    slots = lengths(t, blocks * bs - 1, False)
    mode = rng.random()
    if mode < 0.05:
        # Overlap PyTorch's in-place ops detect (dense tensors sharing memory); strided views
        # whose overlap is too hard to decide are accepted, as PyTorch accepts them.
        vc = kc.view(vc.shape) if dv == d else vc
    elif mode < 0.1:
        kc = torch.zeros(1, bs, n, d, dtype=dtype).expand(blocks, bs, n, d)
    elif mode < 0.15:
        slots = list(range(t)) + [0] if t else [0]
    return (key, value, kc, vc, slots), {}


def bits(t):
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def check_kv(args, kw, result):
    key, value, kc, vc, slots = args
    slots = [int(s) for s in (slots.tolist() if isinstance(slots, torch.Tensor) else slots)]
    bs = kc.shape[1]
    for t, s in enumerate(slots):
        if s >= 0 and not torch.equal(bits(kc[s // bs, s % bs]), bits(key[t])):
            raise AssertionError(f"token {t} not written to slot {s}")


def describe_case():
    plan = opmesh.flash_attn_metadata(4, 2, 16, batch_size=2, max_seqlen_q=70, max_seqlen_kv=90)
    words = plan.clone()
    for _ in range(rng.choice([1, 2, 5])):
        words[rng.randrange(words.numel())] = rng.choice([-1, 0, 1, 3, 2**31 - 1, -(2**31)])
    if rng.random() < 0.2:
        words = words[: rng.randrange(words.numel())]
    return (words,), {}


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
    b, coff, r = pick(0, 1, 2, 3), pick(*[1, 2] * 5, 3), pick(1, 2, 3, 4, 5)
    d, h, dtype = pick(1, 4, 7), pick(1, 5, 9), pick(*DTYPES)
    width = (coff if coff in (1, 2) else 2) * d
    kw = dict(coff=coff)
    if rng.random() < 0.4:
        lens = [rng.randint(0, 9) for _ in range(b)]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        x = plain(cu[-1], h, dtype=dtype)
        kw["cu_seqlens"] = lengths(b, 9, True) if rng.random() < 0.2 else cu
        longest = max(lens, default=0)
    else:
        longest = pick(0, 1, 3, 8, 13)
        x = plain(b, longest, h, dtype=dtype)
    wkv = plain(width + pick(*[0] * 10, 1), h, dtype=dtype)
    wgate = plain(width, h, dtype=pick(*[dtype] * 10, torch.float64))
    ape = plain(pick(*[r] * 10, r + 1), width)
    if rng.random() < 0.3:
        kw["seqused"] = lengths(b, longest, False)
    state = None
    if rng.random() < 0.6:
        mode, bs, blocks = pick(1, 2), pick(1, 2, 4, 8, 16), pick(2, 3, 8, 40)
        state = plain(blocks, bs, 2 * width)

        def block():  # block 0 (none) now and then
            return 0 if rng.random() < 0.05 else rng.randint(1, blocks - 1)

        if mode == 1:
            cols = pick((12 + longest) // bs + 1, (12 + longest) // bs + 1, 1)
            table = [[block() for _ in range(cols)] for _ in range(b)]
        else:
            table = [block() for _ in range(b)]
        if rng.random() < 0.1 and b:
            (table[0] if mode == 1 else table)[0] = pick(-1, blocks)
        kw.update(state_block_table=table, cache_mode=mode, start_pos=lengths(b, 12, False))
    elif rng.random() < 0.2:
        kw["start_pos"] = lengths(b, 12, False)
    BEFORE["state"] = None if state is None else state.clone()
    return (x, wkv, wgate, state, ape, r), kw


def check_compressor(args, kw, result):
    x, wkv, wgate, state, ape, r = args
    want, want_state = compressor_reference(x, wkv, wgate, BEFORE["state"], ape, r, **kw)
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[x.dtype]
    if result.shape != want.shape:
        raise AssertionError(f"shape {tuple(result.shape)}, expected {tuple(want.shape)}")
    if not torch.allclose(result.double(), want, atol=tol, rtol=tol, equal_nan=True):
        raise AssertionError(f"cmp_kv off by {(result.double() - want).abs().max().item()}")
    if state is not None and not torch.allclose(state.double(), want_state, atol=1e-4,
                                                rtol=1e-4, equal_nan=True):  # fmt: skip
        raise AssertionError("state_cache written wrong")


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
        None,
    ),
    "indexer": (
        indexer_case,
        lambda a, kw: opmesh.dense_lightning_indexer_softmax_lse(*a, **kw),
        check_indexer,
    ),
    "kv_cache_write_": (kv_case, lambda a, kw: opmesh.kv_cache_write_(*a), check_kv),
    "describe_metadata": (describe_case, lambda a, kw: opmesh.describe_metadata(*a), None),
}
make, call, check = CASES[op_name]
results = {"ok": 0, "refused": 0, "bad": []}
only = int(sys.argv[4]) if len(sys.argv) > 4 else None
for i in range(count):
    args, kw = make()
    if only is not None and i != only:
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
    try:
        result = call(args, kw)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        message = str(e)
        name = message.split(":", 1)[0].split(",")[0].strip()
        if name not in ARGUMENTS and name != op_name:
            results["bad"].append(
                f"case {i}: {type(e).__name__} names no argument: {message[:300]}"
            )
        else:
            results["refused"] += 1
        continue
    except Exception as e:  # noqa: BLE001
        results["bad"].append(f"case {i}: unexpected {type(e).__name__}: {str(e)[:300]}")
        continue
    if check is not None:
        try:
            check(args, kw, result)
        except AssertionError as e:
            results["bad"].append(
                f"case {i}: wrong result: {e}; "
                f"kw={ {k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)} }"
            )
            continue
    results["ok"] += 1
print("RESULT " + json.dumps(results), flush=True)
