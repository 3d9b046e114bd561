"""Quantized key/value caches (int8 and float8 e4m3fn, one float32 scale per row and head):
kv_cache_write_ quantizing on write, bit for bit against a torch quantizer; flash_attn reading
them on every layout and kernel path against the float64 reference on the dequantized rows; the
argument checks; and the accuracy a cache format costs against the bf16 cache."""

import math

import pytest
import torch
from attention_reference import flash_attn_reference
from comparators import assert_close
from conftest import assert_raises_named
from flash_attn_cases import BY_NAME, TOLERANCES, AttnCase, make_inputs

import opmesh

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize(x, fmt):
    """(bytes, scales) of the rows of x along its last dim, from torch's own operations: scale =
    amax / 127 (int8) or / 448 (fp8); values rounded to nearest even; a zero row has scale 0, a
    row with a NaN or an infinity a NaN scale and zero bytes."""
    top = 127.0 if fmt is torch.int8 else 448.0
    xf = x.float()
    finite = torch.isfinite(xf).all(-1)
    amax = torch.where(finite, xf.abs().amax(-1), 0.0)
    scale = torch.where(finite, amax / top, math.nan)
    usable = finite & (amax > 0)
    y = (xf / torch.where(usable, scale, 1.0)[..., None]).clamp(-top, top)
    y = torch.where(usable[..., None], y, 0.0)
    q = torch.round(y).to(torch.int8) if fmt is torch.int8 else y.to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q, scale, dtype=torch.float64):
    """The rows a quantized cache stands for: each element times its row's scale."""
    return q.to(dtype) * scale.to(dtype)[..., None]


# Decode and prefill over every layout the kernel reads k and v in: paged (block sizes 16 and 64,
# partial and empty sequences), TND varlen with empty sequences, BNSD, odd head dims, windows with
# sinks, GQA 8 and 32/8 decode with whole and partial tiles.
CASES = [
    BY_NAME[n]
    for n in (
        "paged_16_decode",
        "paged_64_decode",
        "paged_64",
        "paged_tnd",
        "decode_tnd",
        "tnd_varlen_empty",
        "bnsd",
        "odd_dims",
        "sinks_window_tnd",
        "gqa8_128",
    )
] + [
    AttnCase(
        "paged_decode_32_8",
        "BSND",
        "PA_BBND",
        (1, 1, 1, 1, 1),
        (0, 1, 63, 65, 200),
        32,
        8,
        128,
        mask_mode=3,
        block_size=64,
    ),
    AttnCase(
        "paged_decode_8_1_odd_block",
        "BSND",
        "PA_BBND",
        (1, 3),
        (129, 40),
        8,
        1,
        64,
        mask_mode=3,
        block_size=24,
        sinks=True,
    ),
]


def quantized_call(case, dtype, fmt, seed=0):
    q, k, v, kw = make_inputs(case, dtype, seed)
    kq, ks = quantize(k, fmt)
    vq, vs = quantize(v, fmt)
    return q, (kq, ks, vq, vs), kw


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reads_match_the_reference_on_the_dequantized_rows(case, dtype, fmt, simd_level):
    q, (kq, ks, vq, vs), kw = quantized_call(case, dtype, FORMATS[fmt])
    out, lse = opmesh.flash_attn(q, kq, vq, k_scale=ks, v_scale=vs, return_softmax_lse=True, **kw)
    want_out, want_lse = flash_attn_reference(q, dequantize(kq, ks), dequantize(vq, vs), **kw)
    out_atol, out_rtol, lse_atol, lse_rtol = TOLERANCES[dtype]
    assert out.dtype == dtype
    assert_close(out, want_out, atol=out_atol, rtol=out_rtol, name="attn_out")
    assert_close(lse, want_lse, atol=lse_atol, rtol=lse_rtol, name="softmax_lse")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", ["paged_64_decode", "paged_tnd"])
def test_calls_of_one_shape_in_a_row_read_their_own_cache(name, fmt, simd_level):
    """A call's scratch (with the dequantized tiles it stages) is kept for the next call of its
    shape: each of a run of same-shaped calls on new cache rows matches the reference."""
    out_atol, out_rtol, lse_atol, lse_rtol = TOLERANCES[torch.bfloat16]
    for seed in (0, 1, 2):
        q, (kq, ks, vq, vs), kw = quantized_call(BY_NAME[name], torch.bfloat16, FORMATS[fmt], seed)
        out, lse = opmesh.flash_attn(
            q, kq, vq, k_scale=ks, v_scale=vs, return_softmax_lse=True, **kw
        )
        want_out, want_lse = flash_attn_reference(q, dequantize(kq, ks), dequantize(vq, vs), **kw)
        assert_close(out, want_out, atol=out_atol, rtol=out_rtol, name="attn_out")
        assert_close(lse, want_lse, atol=lse_atol, rtol=lse_rtol, name="softmax_lse")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", ["paged_64_decode", "paged_tnd", "odd_dims"])
def test_power_of_two_scales_give_the_bits_of_the_same_values_in_bf16(name, fmt, simd_level):
    """With scales that are powers of two, scaling the scores and the probabilities is exact:
    the quantized cache must give the bits of a bf16 cache holding the same values, through every
    score and value path (in place, packed, GEMM)."""
    case = BY_NAME[name]
    q, (kq, _, vq, _), kw = quantized_call(case, torch.bfloat16, FORMATS[fmt], seed=3)
    g = torch.Generator().manual_seed(4)
    ks = 2.0 ** torch.randint(-8, 3, kq.shape[:-1], generator=g).float()
    vs = 2.0 ** torch.randint(-8, 3, vq.shape[:-1], generator=g).float()
    out = opmesh.flash_attn(q, kq, vq, k_scale=ks, v_scale=vs, **kw)[0]
    k, v = dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)
    plain = opmesh.flash_attn(q, k.bfloat16(), v.bfloat16(), **kw)[0]
    assert torch.equal(out, plain)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_write_quantizes_each_row_as_torch_does(dtype, fmt):
    g = torch.Generator().manual_seed(5)
    blocks, bs, heads, d, dv = 5, 16, 3, 40, 24
    key = (torch.randn(9, heads, d, generator=g) * torch.rand(9, heads, 1, generator=g) * 50).to(
        dtype
    )
    value = (torch.randn(9, heads, dv, generator=g) * 1e-3).to(dtype)
    key[1, 0] = 0.0  # scale 0
    key[2, 1, 7] = math.nan  # a NaN row
    value[3, 2, 0] = math.inf  # an infinite row
    key[4, 2] = torch.linspace(-1e-6, 1e-6, d)  # tiny values: fp8 subnormals
    slots = torch.tensor([3, 17, 79, 64, 0, 40, 41, 63, -1])
    kc = torch.zeros(blocks, bs, heads, d, dtype=FORMATS[fmt])
    vc = torch.zeros(blocks, bs, heads, dv, dtype=FORMATS[fmt])
    ksc = torch.full((blocks, bs, heads), -1.0)
    vsc = torch.full((blocks, bs, heads), -1.0)
    want = [t.clone() for t in (kc, vc, ksc, vsc)]
    kq, kscale = quantize(key, FORMATS[fmt])
    vq, vscale = quantize(value, FORMATS[fmt])
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            for w, x in zip(want, (kq, vq, kscale, vscale), strict=True):
                w[s // bs, s % bs] = x[t]
    versions = [t._version for t in (kc, vc, ksc, vsc)]
    opmesh.kv_cache_write_(key, value, kc, vc, slots, key_scale=ksc, value_scale=vsc)
    for got, w in zip((kc, vc), want[:2], strict=True):
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8))
    for got, w in zip((ksc, vsc), want[2:], strict=True):
        assert torch.equal(got.isnan(), w.isnan())
        assert torch.equal(got.nan_to_num(), w.nan_to_num())
    assert all(t._version > n for t, n in zip((kc, vc, ksc, vsc), versions, strict=True))
    # Token 1's zero row (slot 17) has scale 0; token 2's NaN key row (slot 79) and token 3's
    # infinite value row (slot 64) have NaN scales, and read back as NaN, not as finite rows.
    assert ksc[17 // bs, 17 % bs, 0] == 0.0 and math.isnan(ksc[79 // bs, 79 % bs, 1])
    assert math.isnan(vsc[64 // bs, 64 % bs, 2])
    assert dequantize(kc, ksc)[79 // bs, 79 % bs, 1].isnan().all()


def test_write_then_decode_compiles_with_the_scales_written_in_place():
    """kv_cache_write_ with its scales and flash_attn on the quantized cache in one fullgraph
    compiled step, against the same step eagerly."""
    g = torch.Generator().manual_seed(2)
    blocks, bs, heads, d = 4, 64, 2, 64
    caches = lambda: (  # noqa: E731
        torch.zeros(blocks, bs, heads, d, dtype=torch.int8),
        torch.zeros(blocks, bs, heads, d, dtype=torch.int8),
        torch.zeros(blocks, bs, heads),
        torch.zeros(blocks, bs, heads),
    )
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)

    def step(q, key, value, kc, vc, ksc, vsc, slots, used):
        opmesh.kv_cache_write_(key, value, kc, vc, slots, key_scale=ksc, value_scale=vsc)
        return opmesh.flash_attn(
            q, kc, vc, k_scale=ksc, v_scale=vsc, block_table=table, seqused_kv=used, mask_mode=3
        )[0]

    eager, compiled = caches(), caches()
    run = torch.compile(step, fullgraph=True)
    for t in range(3):
        q = torch.randn(2, 1, 8, d, generator=g).bfloat16()
        key = torch.randn(2, heads, d, generator=g).bfloat16()
        value = torch.randn(2, heads, d, generator=g).bfloat16()
        slots = torch.tensor([2 * bs + t, bs + t])
        used = torch.tensor([t + 1, t + 1], dtype=torch.int32)
        want = step(q, key, value, *eager, slots, used)
        got = run(q, key, value, *compiled, slots, used)
        assert torch.equal(got, want)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["plain", *sorted(FORMATS)])
def test_one_shared_key_value_cache_is_written_from_key(fmt):
    """value and value_cache None: key's rows go to key_cache (quantized with key_scale) exactly
    as the two-cache call writes its key side, and nothing else is touched."""
    g = torch.Generator().manual_seed(7)
    key = torch.randn(7, 2, 24, generator=g).bfloat16()
    slots = torch.tensor([5, 0, -1, 33, 20, 47, 8])
    dtype = torch.bfloat16 if fmt == "plain" else FORMATS[fmt]
    fresh = lambda: (  # noqa: E731
        torch.zeros(3, 16, 2, 24, dtype=dtype),
        torch.full((3, 16, 2), -1.0) if fmt != "plain" else None,
    )
    (kc, ksc), (want, want_scale) = fresh(), fresh()
    other = torch.zeros(3, 16, 2, 24, dtype=dtype)
    other_scale = torch.zeros(3, 16, 2) if fmt != "plain" else None
    opmesh.kv_cache_write_(
        key, key, want, other, slots, key_scale=want_scale, value_scale=other_scale
    )
    versions = [t._version for t in (kc, ksc) if t is not None]
    opmesh.kv_cache_write_(key, None, kc, None, slots, key_scale=ksc)
    assert torch.equal(kc.view(torch.uint8), want.view(torch.uint8))
    if fmt != "plain":
        assert torch.equal(ksc, want_scale)
    assert all(t._version > n for t, n in zip((kc, ksc), versions, strict=False))
    opmesh.kv_cache_write_(key[:0], None, kc, None, slots[:0], key_scale=ksc)  # nothing to write
    assert torch.equal(kc.view(torch.uint8), want.view(torch.uint8))


def test_shared_cache_write_then_mla_decode_compiles():
    """kv_cache_write_ into one int8 latent cache and sparse_flash_mla reading it in one fullgraph
    compiled step, against the same step eagerly."""
    g = torch.Generator().manual_seed(4)
    blocks, bs, d = 3, 16, 32
    fresh = lambda: (torch.zeros(blocks, bs, 1, d, dtype=torch.int8), torch.zeros(blocks, bs, 1))  # noqa: E731
    table = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32)

    def step(q, kv, cache, scale, slots, used):
        opmesh.kv_cache_write_(kv, None, cache, None, slots, key_scale=scale)
        return opmesh.sparse_flash_mla(
            q, ori_kv=cache, ori_kv_scale=scale, ori_block_table=table, seqused_ori_kv=used,
            layout_kv="PA_BBND", ori_mask_mode=3, softmax_scale=d**-0.5,
        )[0]  # fmt: skip

    eager, compiled = fresh(), fresh()
    run = torch.compile(step, fullgraph=True)
    for t in range(3):
        q = torch.randn(2, 1, 4, d, generator=g).bfloat16()
        kv = torch.randn(2, 1, d, generator=g).bfloat16()
        slots = torch.tensor([2 * bs + t, bs + t])
        used = torch.tensor([t + 1, t + 1], dtype=torch.int32)
        want = step(q, kv, *eager, slots, used)
        assert torch.equal(run(q, kv, *compiled, slots, used), want)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def test_opcheck():
    torch.library.opcheck(
        torch.ops.opmesh.kv_cache_write_.default,
        (torch.randn(4, 1, 32), None, torch.zeros(3, 16, 1, 32, dtype=torch.int8), None,
         torch.tensor([1, 2, -1, 40])),
        dict(key_scale=torch.zeros(3, 16, 1)),
    )  # fmt: skip
    kc = torch.zeros(3, 16, 2, 32, dtype=torch.int8)
    vc = torch.zeros(3, 16, 2, 24, dtype=torch.int8)
    ksc, vsc = torch.zeros(3, 16, 2), torch.zeros(3, 16, 2)
    key, value = torch.randn(4, 2, 32), torch.randn(4, 2, 24)
    torch.library.opcheck(
        torch.ops.opmesh.kv_cache_write_.default,
        (key, value, kc, vc, torch.tensor([1, 2, -1, 40])),
        dict(key_scale=ksc, value_scale=vsc),
    )
    q = torch.randn(2, 1, 4, 32)
    torch.library.opcheck(
        torch.ops.opmesh.flash_attn.default,
        (q, kc, vc),
        dict(
            k_scale=ksc,
            v_scale=vsc,
            block_table=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32),
            seqused_kv=torch.tensor([20, 5], dtype=torch.int32),
            layout_kv="PA_BBND",
        ),
    )


def _paged(fmt=torch.int8):
    kc = torch.zeros(3, 16, 2, 32, dtype=fmt)
    return dict(
        q=torch.randn(2, 1, 4, 32),
        k=kc,
        v=torch.zeros(3, 16, 2, 32, dtype=fmt),
        k_scale=torch.ones(3, 16, 2),
        v_scale=torch.ones(3, 16, 2),
        block_table=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32),
        seqused_kv=torch.tensor([20, 5], dtype=torch.int32),
    )


def _fa(**change):
    call = {**_paged(), **change}
    call = {n: x for n, x in call.items() if x is not None}
    return lambda: opmesh.flash_attn(call.pop("q"), call.pop("k"), call.pop("v"), **call)


def _write(**change):
    call = dict(
        key=torch.randn(2, 2, 32),
        value=torch.randn(2, 2, 32),
        key_cache=torch.zeros(3, 16, 2, 32, dtype=torch.int8),
        value_cache=torch.zeros(3, 16, 2, 32, dtype=torch.int8),
        slot_mapping=[0, 5],
        key_scale=torch.zeros(3, 16, 2),
        value_scale=torch.zeros(3, 16, 2),
    )
    call.update(change)
    kept = ("key_scale", "value_scale", "value", "value_cache")  # None is a value of these
    call = {n: x for n, x in call.items() if x is not None or n in kept}
    return lambda: opmesh.kv_cache_write_(**call)


ERRORS = {
    "fa_k_scale_missing": (ValueError, "k_scale", _fa(k_scale=None)),
    "fa_v_scale_missing": (ValueError, "v_scale", _fa(v_scale=None)),
    "fa_scale_on_plain": (
        ValueError,
        "k_scale",
        _fa(k=torch.zeros(3, 16, 2, 32), v=torch.zeros(3, 16, 2, 32)),
    ),
    "fa_scale_dtype": (TypeError, "v_scale", _fa(v_scale=torch.ones(3, 16, 2).double())),
    "fa_scale_shape": (ValueError, "k_scale", _fa(k_scale=torch.ones(3, 16, 1))),
    "fa_v_other_format": (
        TypeError,
        "v",
        _fa(v=torch.zeros(3, 16, 2, 32, dtype=torch.float8_e4m3fn)),
    ),
    "fa_k_other_int": (TypeError, "k", _fa(k=torch.zeros(3, 16, 2, 32, dtype=torch.int16))),
    "fa_strided_cache": (
        ValueError,
        "k",
        _fa(k=torch.zeros(3, 16, 2, 64, dtype=torch.int8)[..., ::2]),
    ),
    "fa_grad": (ValueError, "k_scale", _fa(q=torch.randn(2, 1, 4, 32, requires_grad=True))),
    "write_scale_missing": (ValueError, "key_scale", _write(key_scale=None)),
    "write_value_scale_missing": (ValueError, "value_scale", _write(value_scale=None)),
    "write_scale_on_plain": (
        ValueError,
        "key_scale",
        _write(key_cache=torch.zeros(3, 16, 2, 32), value_cache=torch.zeros(3, 16, 2, 32)),
    ),
    "write_scale_shape": (ValueError, "value_scale", _write(value_scale=torch.zeros(3, 16, 3))),
    "write_scale_dtype": (TypeError, "key_scale", _write(key_scale=torch.zeros(3, 16, 2).half())),
    "write_mixed_formats": (
        TypeError,
        "value_cache",
        _write(value_cache=torch.zeros(3, 16, 2, 32, dtype=torch.float8_e4m3fn)),
    ),
    "write_key_not_floating": (
        TypeError,
        "key",
        _write(key=torch.zeros(2, 2, 32, dtype=torch.int8)),
    ),
}


def _shared_scales():
    s = torch.zeros(2, 3, 16, 2)
    return _write(key_scale=s[0], value_scale=s[0])


ERRORS["write_scales_shared"] = (ValueError, "value_scale", _shared_scales())
# One cache of rows read as key and value: value and value_cache both None, and no value_scale.
ERRORS["write_value_without_cache"] = (ValueError, "value_cache", _write(value_cache=None))
ERRORS["write_cache_without_value"] = (ValueError, "value", _write(value=None))
ERRORS["write_shared_value_scale"] = (
    ValueError,
    "value_scale",
    _write(value=None, value_cache=None),
)


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_bad_input_names_the_argument(name):
    exc, argument, fn = ERRORS[name]
    assert_raises_named(exc, argument, fn)


# The accuracy a format costs: a tiny model's attention layers decode with the cache in each
# format and with the bf16 cache, and the final logits' mean and largest differences are taken
# relative to the logits' spread (standard deviation). Measured over seeds 0-4 (mean, max): int8
# 0.0049-0.0052, 0.030-0.040; fp8 0.017-0.019, 0.099-0.137 (docs/ops/kv_cache_write.md). The
# bounds leave about 1.5x of margin.
ACCURACY_BOUNDS = {"int8": (0.008, 0.06), "fp8": (0.028, 0.2)}


def _decode_logits(fmt, steps=24, seed=0):
    """A 2-layer attention stack (8/2 heads of 32) reading the same `steps` tokens for 3 sequences
    one at a time over a paged cache in `fmt` (None: bf16), returning the logits of every step."""
    g = torch.Generator().manual_seed(seed)
    hidden, nq, nkv, d, vocab, bs = 256, 8, 2, 32, 64, 16
    layers = [
        {
            n: torch.randn(hidden, c, generator=g) / math.sqrt(hidden)
            for n, c in (("q", nq * d), ("k", nkv * d), ("v", nkv * d))
        }
        | {"o": torch.randn(nq * d, hidden, generator=g) / math.sqrt(nq * d)}
        for _ in range(2)
    ]
    embed = torch.randn(vocab, hidden, generator=g)
    head = torch.randn(hidden, vocab, generator=g) / math.sqrt(hidden)
    batch, blocks = 3, 3 * math.ceil(steps / bs)
    table = torch.arange(blocks, dtype=torch.int32).view(batch, -1)
    dtype = torch.bfloat16 if fmt is None else FORMATS[fmt]
    caches = [
        (
            torch.zeros(blocks, bs, nkv, d, dtype=dtype),
            torch.zeros(blocks, bs, nkv, d, dtype=dtype),
            torch.zeros(blocks, bs, nkv),
            torch.zeros(blocks, bs, nkv),
        )
        for _ in layers
    ]
    inputs = torch.randint(0, vocab, (steps, batch), generator=g)
    out = []
    for t in range(steps):
        x = embed[inputs[t]].bfloat16()
        slots = table[:, t // bs].long() * bs + t % bs
        used = torch.full((batch,), t + 1, dtype=torch.int32)
        for w, (kc, vc, ksc, vsc) in zip(layers, caches, strict=True):
            q = (x.float() @ w["q"]).bfloat16().view(batch, 1, nq, d)
            k = (x.float() @ w["k"]).bfloat16().view(batch, nkv, d)
            v = (x.float() @ w["v"]).bfloat16().view(batch, nkv, d)
            scales = {} if fmt is None else dict(key_scale=ksc, value_scale=vsc)
            opmesh.kv_cache_write_(k, v, kc, vc, slots, **scales)
            reads = {} if fmt is None else dict(k_scale=ksc, v_scale=vsc)
            a = opmesh.flash_attn(q, kc, vc, block_table=table, seqused_kv=used, **reads)[0]
            x = (x.float() + a.view(batch, -1).float() @ w["o"]).bfloat16()
        out.append(x.float() @ head)
    return torch.stack(out)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_accuracy_against_the_bf16_cache_is_within_the_format_bound(fmt):
    want = _decode_logits(None)
    got = _decode_logits(fmt)
    diff = (got - want).abs() / want.std()
    mean_bound, max_bound = ACCURACY_BOUNDS[fmt]
    assert diff.mean() < mean_bound and diff.amax() < max_bound, (diff.mean(), diff.amax())
    assert diff.mean() > mean_bound / 10  # the cache is really quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_fp8_value_reads_as_torch_converts_it(dtype, simd_level):
    """Keys and values made of every finite float8 e4m3fn byte (subnormals, zeros of both signs,
    the largest magnitudes), in rows with and without subnormals, on every kernel path."""
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    g = torch.Generator().manual_seed(9)
    rows = torch.stack([finite[torch.randperm(254, generator=g)[:64]] for _ in range(2 * 64 * 2)])
    rows[: 2 * 64] &= 0xF7  # half the rows without exponent bit 0: more subnormals and zeros
    kq = rows[: 2 * 64].view(2, 64, 1, 64).view(torch.float8_e4m3fn)
    vq = rows[2 * 64 :].view(2, 64, 1, 64).view(torch.float8_e4m3fn)
    ks = torch.rand(2, 64, 1, generator=g) / 200
    vs = torch.rand(2, 64, 1, generator=g) / 200
    q = torch.randn(2, 1, 4, 64, generator=g).to(dtype)
    kw = dict(block_table=torch.tensor([[1], [0]], dtype=torch.int32))
    kw["seqused_kv"] = torch.tensor([64, 50], dtype=torch.int32)
    out, lse = opmesh.flash_attn(q, kq, vq, k_scale=ks, v_scale=vs, return_softmax_lse=True, **kw)
    want_out, want_lse = flash_attn_reference(
        q, dequantize(kq, ks), dequantize(vq, vs), layout_kv="PA_BBND", **kw
    )
    out_atol, out_rtol, lse_atol, lse_rtol = TOLERANCES[dtype]
    assert_close(out, want_out, atol=out_atol, rtol=out_rtol, name="attn_out")
    assert_close(lse, want_lse, atol=lse_atol, rtol=lse_rtol, name="softmax_lse")


# DSA decode from a quantized cache (Ascend's kv-quant form): sparse_flash_attention gathers the
# selected int8 / e4m3 rows with their scales; key_rope stays in query's dtype.
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["decode", "rope_blocks_4", "varlen", "paged"])
def test_sparse_attention_reads_a_quantized_key_and_value(name, dtype, fmt, simd_level):
    import test_sparse_flash_attention as sfa

    case = next(c for c in sfa.CASES if c.name == name)
    q, k, v, idx, kw = sfa.make_inputs(case, dtype)
    (kq, ks), (vq, vs) = quantize(k, FORMATS[fmt]), quantize(v, FORMATS[fmt])
    out, smax, ssum = opmesh.sparse_flash_attention(
        q, kq, vq, idx, sfa.SCALE, return_softmax_lse=True, key_scale=ks, value_scale=vs, **kw
    )
    # The rows the kernel computes on: dequantized in float32, rounded to bf16 where bf16 queries
    # run on bf16 pairs.
    pairs = dtype == torch.bfloat16 and ("pairs" in simd_level or "amx" in simd_level)
    k_rows, v_rows = (dequantize(x, s, torch.float32) for x, s in ((kq, ks), (vq, vs)))
    if pairs:
        k_rows, v_rows = k_rows.bfloat16(), v_rows.bfloat16()
    want, wmax, wsum = sfa.reference(q, k_rows, v_rows, idx, sfa.SCALE, **kw)
    tol = sfa.FORWARD_TOL[dtype]
    torch.testing.assert_close(sfa.rows_of(out, case).double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(sfa.stats_rows(smax, case).double(), wmax, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(sfa.stats_rows(ssum, case).double(), wsum, atol=2e-5, rtol=2e-5)


SPARSE_ERRORS = {
    "scale_missing": ("value_scale", dict(value_scale=None)),
    "scale_shape": ("key_scale", dict(key_scale=torch.ones(2, 37, 1))),
    "scale_on_plain": (
        "key_scale",
        dict(key=torch.randn(2, 37, 2, 16), value=torch.randn(2, 37, 2, 12)),
    ),
    "value_plain": ("value", dict(value=torch.randn(2, 37, 2, 12))),
    "grad": ("key_scale", dict(query=torch.randn(2, 37, 4, 16, requires_grad=True))),
}


@pytest.mark.parametrize("name", sorted(SPARSE_ERRORS))
def test_sparse_attention_refuses_a_bad_quantized_call_by_name(name):
    import test_sparse_flash_attention as sfa

    q, k, v, idx, kw = sfa.make_inputs(sfa.CASES[0], torch.float32)
    (kq, ks), (vq, vs) = quantize(k, torch.int8), quantize(v, torch.int8)
    call = dict(query=q, key=kq, value=vq, key_scale=ks, value_scale=vs)
    argument, change = SPARSE_ERRORS[name]
    call.update(change)
    exc = TypeError if name == "value_plain" else ValueError
    assert_raises_named(
        exc,
        argument,
        lambda: opmesh.sparse_flash_attention(
            call.pop("query"), call.pop("key"), call.pop("value"), idx, 0.3, **call, **kw
        ),
    )


# DeepSeek-V4's decode from a quantized cache: sparse_flash_mla reads int8 / e4m3 ori_kv and
# cmp_kv rows (shared key/value, one scale per row) with ori_kv_scale / cmp_kv_scale, on every
# layout of its grid (SWA, HCA, CSA, paged, TND with empty sequences, cmp_kv alone).
def _mla_quantized(case, dtype, fmt, sides=("ori", "cmp")):
    import test_sparse_flash_mla as mla

    q, kw = mla.make_inputs(case, dtype)
    rows = dict(kw)  # the reference's call: the dequantized rows
    for side in sides:
        kv = kw.get(f"{side}_kv")
        if kv is None:
            continue
        kw[f"{side}_kv"], kw[f"{side}_kv_scale"] = quantize(kv, FORMATS[fmt])
        rows[f"{side}_kv"] = dequantize(kw[f"{side}_kv"], kw[f"{side}_kv_scale"], torch.float32)
    return q, kw, rows


def _mla_rows_as_the_kernel_reads_them(rows, dtype, simd_level):
    """Dequantized in float32, rounded to bf16 where bf16 queries run on bf16 pairs; plain rows
    stay in q's dtype."""
    pairs = dtype == torch.bfloat16 and ("pairs" in simd_level or "amx" in simd_level)
    for side in ("ori", "cmp"):
        kv = rows.get(f"{side}_kv")
        if kv is not None and kv.dtype == torch.float32 and dtype != torch.float32:
            rows[f"{side}_kv"] = kv.bfloat16() if pairs else kv
    return rows


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "name", ["swa", "hca_gqa", "csa_tnd", "decode_paged_hca", "csa_tnd_paged", "cmp_only"]
)
def test_sparse_flash_mla_reads_a_quantized_cache(name, dtype, fmt, simd_level):
    import test_sparse_flash_mla as mla

    case = next(c for c in mla.CASES if c.name == name)
    q, kw, rows = _mla_quantized(case, dtype, fmt)
    out, lse = opmesh.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    rows = _mla_rows_as_the_kernel_reads_them(rows, dtype, simd_level)
    want, wlse = mla.reference(q, **rows)
    tol = mla.FORWARD_TOL[dtype]
    torch.testing.assert_close(mla.rows_of(out, case).double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(mla.lse_rows(lse, case).double(), wlse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("side", ["ori", "cmp"])
def test_sparse_flash_mla_takes_one_quantized_side_and_a_plan(side):
    """A quantized ori_kv with a plain cmp_kv (and the other way), planned over 3 workers: the
    planned call equals the unplanned one, and both the reference on the dequantized rows."""
    import test_sparse_flash_mla as mla

    case = next(c for c in mla.CASES if c.name == "csa_tnd")
    q, kw, rows = _mla_quantized(case, torch.float32, "int8", sides=(side,))
    other = "cmp" if side == "ori" else "ori"
    assert kw[f"{other}_kv"].dtype == torch.float32 and f"{other}_kv_scale" not in kw
    out, lse = opmesh.sparse_flash_mla(q, return_softmax_lse=True, **kw)
    plan = mla.plan_for(case, kw, q)
    planned, _ = opmesh.sparse_flash_mla(q, metadata=plan, return_softmax_lse=True, **kw)
    torch.testing.assert_close(planned, out, atol=1e-6, rtol=1e-6)
    want, _ = mla.reference(q, **rows)
    torch.testing.assert_close(mla.rows_of(out, case).double(), want, atol=2e-5, rtol=2e-5)


def test_sparse_flash_mla_quantized_compiles_and_passes_opcheck():
    import test_sparse_flash_mla as mla

    case = next(c for c in mla.CASES if c.name == "decode_paged_hca")
    q, kw, _ = _mla_quantized(case, torch.bfloat16, "int8")
    torch.library.opcheck(mla.OP, (q,), dict(kw))
    eager, _ = opmesh.sparse_flash_mla(q, **kw)
    compiled = torch.compile(lambda q, kw: opmesh.sparse_flash_mla(q, **kw)[0], fullgraph=True)
    assert torch.equal(compiled(q, kw), eager)


MLA_ERRORS = {
    "scale_missing": ("ori_kv_scale", dict(ori_kv_scale=None)),
    "scale_shape": ("cmp_kv_scale", dict(cmp_kv_scale=torch.ones(5, 2))),
    "scale_dtype": ("ori_kv_scale", "double"),
    "scale_on_plain": ("cmp_kv_scale", "plain_cmp"),
    "scale_without_kv": ("cmp_kv_scale", "no_cmp"),
    "strided": ("ori_kv", "strided"),
    "grad": ("ori_kv_scale", "grad"),
}


@pytest.mark.parametrize("name", sorted(MLA_ERRORS))
def test_sparse_flash_mla_refuses_a_bad_quantized_call_by_name(name):
    import test_sparse_flash_mla as mla

    case = next(c for c in mla.CASES if c.name == "swa")
    q, kw, _ = _mla_quantized(case, torch.float32, "int8")
    case_cmp = next(c for c in mla.CASES if c.name == "hca_gqa")
    argument, change = MLA_ERRORS[name]
    if change == "double":
        kw["ori_kv_scale"] = kw["ori_kv_scale"].double()
    elif change == "plain_cmp":
        q, kw, _ = _mla_quantized(case_cmp, torch.float32, "int8", sides=("ori",))
        kw["cmp_kv_scale"] = torch.ones(kw["cmp_kv"].shape[:-1])
    elif change == "no_cmp":
        kw["cmp_kv_scale"] = torch.ones(2, 3, 1)
    elif change == "strided":
        kv = kw["ori_kv"]
        kw["ori_kv"] = torch.zeros(*kv.shape[:-1], 2 * kv.shape[-1], dtype=kv.dtype)[..., ::2]
    elif change == "grad":
        q.requires_grad_(True)
    else:
        kw.update(change)
    exc = TypeError if name == "scale_dtype" else ValueError
    assert_raises_named(exc, argument, lambda: opmesh.sparse_flash_mla(q, **kw))


# Keys with no rows: the scales are empty too and may have no storage at all (a fresh empty
# tensor), or the keys a view of a larger cache's storage. Every query row sees no key.
EMPTY_KEYS = {
    "tnd_fresh": ("TND", lambda fmt: torch.zeros(0, 1, 16, dtype=fmt)),
    "tnd_view": ("TND", lambda fmt: torch.zeros(4, 1, 16, dtype=fmt)[:0]),
    "bsnd": ("BSND", lambda fmt: torch.zeros(2, 0, 1, 16, dtype=fmt)),
    "paged": ("PA_BSND", lambda fmt: torch.zeros(0, 4, 1, 16, dtype=fmt)),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", sorted(EMPTY_KEYS))
def test_sparse_operators_take_quantized_keys_with_no_rows(name, fmt):
    layout, make = EMPTY_KEYS[name]
    kv = make(FORMATS[fmt])
    scale = torch.zeros(kv.shape[:-1])
    tnd = layout == "TND"
    q = torch.randn(3, 4, 16) if tnd else torch.randn(2, 3, 4, 16)
    idx = torch.full((*q.shape[:-2], 1, 2), -1, dtype=torch.int32)
    kw = dict(layout_query="TND" if tnd else "BSND", layout_kv=layout, sparse_mode=0)
    if tnd:
        kw.update(actual_seq_lengths_query=[1, 3], actual_seq_lengths_kv=[0, 0])
    elif layout == "PA_BSND":
        kw.update(block_table=torch.zeros(2, 1, dtype=torch.int32), actual_seq_lengths_kv=[0, 0])
    out, smax, ssum = opmesh.sparse_flash_attention(
        q, kv, kv, idx, 0.25, key_scale=scale, value_scale=scale, return_softmax_lse=True, **kw
    )
    assert torch.equal(out, torch.zeros_like(q)) and (ssum == 0).all()
    mla = dict(layout_q=kw["layout_query"], layout_kv=layout.replace("PA_BSND", "PA_BBND"))
    mla["ori_mask_mode"] = 0
    if tnd:
        mla.update(cu_seqlens_q=[0, 1, 3], cu_seqlens_ori_kv=[0, 0, 0])
    elif layout == "PA_BSND":
        mla.update(ori_block_table=kw["block_table"], seqused_ori_kv=[0, 0])
    out, lse = opmesh.sparse_flash_mla(
        q, ori_kv=kv, ori_kv_scale=scale, return_softmax_lse=True, **mla
    )
    assert torch.equal(out, torch.zeros_like(q)) and (lse == -math.inf).all()
