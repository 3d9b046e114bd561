"""compressor against the float64 reference (reference.compressor) on a grid of layouts, ratios,
coff, awkward sizes, lengths, start positions and state caches (continuous and ring); decoding
chunk by chunk through the state equals one prefill; transformers' V4 compressors; gradients
(against the reference's autograd, gradcheck, any thread count); graph mode; errors by name."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import assert_raises_named
from reference import compressor as reference

import opmesh

TOL = {torch.float32: 2e-5, torch.float64: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple  # tokens of x per sequence
    ratio: int
    coff: int
    dim: int = 6
    hidden: int = 9
    packed: bool = False
    seqused: tuple | None = None
    start: tuple | None = None
    cache_mode: int = 1  # with a state cache when start is given
    block_size: int = 4


CASES = [
    Case("c4_coff2_bsh", (13, 13), 4, 2),
    Case("c128_like_bsh", (20, 20), 8, 1, dim=16, hidden=33),
    Case("ratio1", (5, 5), 1, 1),
    Case("ratio1_coff2", (5, 5), 1, 2),
    Case("odd_ratio_tnd", (11, 0, 7), 3, 2, packed=True),
    Case("tnd_seqused", (12, 9), 4, 1, packed=True, seqused=(10, 0)),
    Case("bsh_seqused", (9, 9), 2, 2, seqused=(9, 4)),
    Case("start_continuous", (7, 7), 4, 2, start=(5, 8)),
    Case("start_ring", (6, 6), 4, 2, start=(9, 3), cache_mode=2, block_size=8),
    Case("start_tnd_ring", (5, 3, 6), 3, 1, packed=True, start=(4, 0, 7), cache_mode=2),
    Case("hidden1_dim1", (8, 8), 4, 2, dim=1, hidden=1),
    Case("shorter_than_ratio", (3, 2), 4, 2),
    Case("no_sequences", (), 4, 2, packed=True),
    Case("empty_batch", (0, 0), 4, 1),
    # coff D odd: a word of bf16 pairs holds a row of wkv and one of wgate.
    Case("odd_dim", (10, 7), 3, 1, dim=5, hidden=7, seqused=(10, 6)),
    # The backward's products in several blocks: 160 channels (two of 64 and a part), 299 and
    # 157 tokens, 70 hidden (a panel of 64 and a part).
    Case("large", (299, 157), 4, 2, dim=40, hidden=70, packed=True),
    # The weight gradients' columns in more than one task (1100 > 16 panels of 64).
    Case("wide_hidden", (9, 6), 4, 1, dim=3, hidden=1100),
]


def make(case: Case, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = case.coff * case.dim
    if case.packed:
        x = torch.randn(sum(case.lengths), case.hidden, generator=g)
        cu = torch.tensor([0, *torch.tensor(case.lengths, dtype=torch.long).cumsum(0).tolist()])
    else:
        x = torch.randn(len(case.lengths), case.lengths[0] if case.lengths else 0, case.hidden,
                        generator=g)  # fmt: skip
        cu = None
    wkv = torch.randn(width, case.hidden, generator=g) / case.hidden**0.5
    wgate = torch.randn(width, case.hidden, generator=g) / case.hidden**0.5
    ape = torch.randn(case.ratio, width, generator=g)
    kwargs = dict(cu_seqlens=cu, coff=case.coff)
    if case.seqused is not None:
        kwargs["seqused"] = torch.tensor(case.seqused)
    state = None
    if case.start is not None:
        batch = len(case.lengths)
        kwargs["start_pos"] = torch.tensor(case.start)
        kwargs["cache_mode"] = case.cache_mode
        if case.cache_mode == 1:
            width_blocks = (max(case.start) + max(case.lengths)) // case.block_size + 1
            table = 1 + torch.arange(batch * width_blocks).view(batch, width_blocks)
        else:
            table = 1 + torch.arange(batch)
        kwargs["state_block_table"] = table
        state = torch.randn(int(table.max()) + 1, case.block_size, 2 * width, generator=g)
    cast = [t.to(dtype) for t in (x, wkv, wgate)]
    return (*cast, state, ape), kwargs


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_reference(case, dtype, simd_level):
    (x, wkv, wgate, state, ape), kwargs = make(case, dtype)
    want, want_state = reference(x, wkv, wgate, state, ape, case.ratio, **kwargs)
    state_copy = None if state is None else state.clone()
    got = opmesh.compressor(x, wkv, wgate, state_copy, ape, case.ratio, **kwargs)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    if state is not None:
        # The kv and score rows of this call's tokens, in float32 from the same inputs.
        torch.testing.assert_close(state_copy.double(), want_state, atol=1e-5, rtol=1e-5)


def test_padding_rows_are_zero():
    case = Case("pad", (10, 10), 4, 2, seqused=(10, 3))
    (x, wkv, wgate, _, ape), kwargs = make(case)
    out = opmesh.compressor(x, wkv, wgate, None, ape, 4, **kwargs)
    assert out.shape == (2, 3, 6)
    assert out[0, 2:].abs().sum() == 0 and out[1].abs().sum() == 0  # 2 entries, then none
    packed = Case("pad_tnd", (10, 3), 4, 1, packed=True)
    (x, wkv, wgate, _, ape), kwargs = make(packed)
    out = opmesh.compressor(x, wkv, wgate, None, ape, 4, **kwargs)
    assert out.shape == (min(13, 13 // 4 + 2), 6)
    assert out[2:].abs().sum() == 0 and out[:2].abs().sum() > 0


@pytest.mark.parametrize("cache_mode", [1, 2])
@pytest.mark.parametrize("coff,ratio", [(2, 4), (1, 8), (2, 3)])
def test_decoding_chunk_by_chunk_equals_prefill(cache_mode, coff, ratio):
    """Tokens fed in chunks (one at a time included), each call reading the earlier ones from the
    state cache, emit the same entries as one call over the whole sequence."""
    g = torch.Generator().manual_seed(1)
    d, h, s = 5, 11, 29
    x = torch.randn(2, s, h, generator=g)
    wkv, wgate = torch.randn(coff * d, h, generator=g), torch.randn(coff * d, h, generator=g)
    ape = torch.randn(ratio, coff * d, generator=g)
    full = opmesh.compressor(x, wkv, wgate, None, ape, ratio, coff=coff)
    block = 4 if cache_mode == 1 else coff * ratio + 1
    table = (1 + torch.arange(2 * 8).view(2, 8)) if cache_mode == 1 else torch.tensor([3, 1])
    state = torch.full((17, block, 2 * coff * d), float("nan"))  # never read before written
    got, pos = [[], []], 0
    for chunk in (1, 2, 1, 5, 1, 1, 7, 3, 8):
        out = opmesh.compressor(x[:, pos : pos + chunk], wkv, wgate, state, ape, ratio,
                                state_block_table=table, start_pos=[pos, pos], coff=coff,
                                cache_mode=cache_mode)  # fmt: skip
        emitted = (pos + chunk) // ratio - pos // ratio
        for b in range(2):
            got[b].append(out[b, :emitted])
            assert out[b, emitted:].abs().sum() == 0
        pos += chunk
    assert pos == s
    whole = full[:, : s // ratio]  # the last row of full is padding when ratio does not divide s
    torch.testing.assert_close(torch.stack([torch.cat(r) for r in got]), whole, atol=0, rtol=0)


def test_block_zero_is_not_stored():
    case = Case("zero", (8,), 4, 1, start=(0,), block_size=4)
    (x, wkv, wgate, state, ape), kwargs = make(case)
    kwargs["state_block_table"] = torch.tensor([[0, 2, 3, 1]])
    before = state.clone()
    opmesh.compressor(x, wkv, wgate, state, ape, 4, **kwargs)
    assert torch.equal(state[0], before[0]) and not torch.equal(state[2], before[2])


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "cache_mode, table",
    [(1, []), (1, torch.zeros(0, 3, dtype=torch.int32)), (2, []), (2, torch.zeros(0))],
)
def test_a_state_cache_with_no_sequences(cache_mode, table, packed):
    """No sequences read or write the cache: the call returns no entries and leaves it alone; a
    state cache without a table is still refused."""
    wkv, wgate, ape = torch.randn(6, 5), torch.randn(6, 5), torch.randn(4, 6)
    state = torch.randn(3, 8, 12)
    before = state.clone()
    x = torch.randn(0, 5) if packed else torch.randn(0, 7, 5)
    kw = dict(cu_seqlens=[0]) if packed else {}
    table = table.long() if isinstance(table, torch.Tensor) else table
    out = opmesh.compressor(x, wkv, wgate, state, ape, 4, state_block_table=table, start_pos=[],
                            coff=1, cache_mode=cache_mode, **kw)  # fmt: skip
    assert out.shape == ((0, 6) if packed else (0, 2, 6)) and torch.equal(state, before)
    assert_raises_named(
        ValueError,
        "state_block_table",
        lambda: opmesh.compressor(x, wkv, wgate, state, ape, 4, cache_mode=cache_mode, **kw),
    )


def test_state_version_counter_advances():
    case = Case("version", (8,), 4, 1, start=(0,))
    (x, wkv, wgate, state, ape), kwargs = make(case)
    version = state._version
    opmesh.compressor(x, wkv, wgate, state, ape, 4, **kwargs)
    assert state._version > version


# --- transformers' compressors -------------------------------------------------------------


class NoIndexer(torch.nn.Module):
    """Stands in for the CSA compressor's indexer (its top-k is not what is compared here)."""

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros(*hidden_states.shape[:2], 1, dtype=torch.long)


def test_transformers_v4_compressors(monkeypatch):
    """transformers' CSA (coff 2, ratio 4) and HCA compressors, stateless, before their RMSNorm
    and rotary embedding (both switched off here: they act on the compressor's output)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("this transformers has no deepseek_v4")
    from test_v4_layer import tiny_config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    monkeypatch.setattr(v4, "apply_rotary_pos_emb", lambda x, cos, sin: x)
    config = tiny_config()
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, config.hidden_size)
    positions = torch.arange(37).expand(2, -1)
    for cls, kind, coff in (
        (v4.DeepseekV4CSACompressor, "compressed_sparse_attention", 2),
        (v4.DeepseekV4HCACompressor, "heavily_compressed_attention", 1),
    ):
        module = cls(config).eval()
        with torch.no_grad():
            for p in (module.kv_proj.weight, module.gate_proj.weight, module.position_bias):
                p.normal_()
        module.kv_norm = torch.nn.Identity()
        if coff == 2:
            module.indexer = NoIndexer()
        with torch.no_grad():
            want = module(hidden, None, positions, None, 0)[0][:, 0]
            got = opmesh.compressor(
                hidden,
                module.kv_proj.weight,
                module.gate_proj.weight,
                None,
                module.position_bias,
                config.compress_rates[kind],
                coff=coff,
            )
        assert want.shape[1] == 37 // config.compress_rates[kind]
        torch.testing.assert_close(got[:, : want.shape[1]], want, atol=1e-5, rtol=1e-5)


# --- gradients ---------------------------------------------------------------------------


GRAD_CASES = [c for c in CASES if c.start is None or not any(c.start)]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_match_reference(case, dtype, simd_level):
    """Gradients against the float64 reference's autograd on the same (dtype-rounded) inputs:
    float32 to float32 rounding; bf16 (whose products may run on bf16 pairs, the upstream and
    intermediate gradients rounded to bf16 as PyTorch's bf16 backward rounds them) to 2% of each
    gradient's largest entry."""
    (x, wkv, wgate, _, ape), kwargs = make(case, dtype)
    ape = ape.to(dtype)
    up = None
    grads = []
    for fn in (opmesh.compressor, reference):
        leaves = [t.detach().requires_grad_(True) for t in (x, wkv, wgate, ape)]
        if fn is reference:
            leaves = [t.detach().double().requires_grad_(True) for t in leaves]
        out = fn(leaves[0], leaves[1], leaves[2], None, leaves[3], case.ratio, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if not out.requires_grad:  # the reference emits no entry: every gradient is zero
            grads.append([None] * 4)
            continue
        if up is None:
            up = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        grads.append(torch.autograd.grad((out * up.to(out.dtype)).sum(), leaves,
                                         allow_unused=True))  # fmt: skip
    for name, a, b in zip(("x", "wkv", "wgate", "ape"), *grads, strict=True):
        assert a.dtype == dtype
        b = torch.zeros_like(a, dtype=torch.float64) if b is None else b
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=5e-5, msg=name)
        else:
            scale = max(b.abs().max().item() if b.numel() else 0.0, 1e-3)
            torch.testing.assert_close(a.double(), b, atol=2e-2 * scale, rtol=0, msg=name)


PROJECTED = ("c4_coff2_bsh", "odd_ratio_tnd", "tnd_seqused", "bsh_seqused", "start_continuous",
             "odd_dim")  # fmt: skip
PROJECTION_CASES = [c for c in CASES if c.name in PROJECTED]


@pytest.mark.parametrize("case", PROJECTION_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_projections_are_written_and_read_back(case, dtype, simd_level):
    """``projections`` receives [wkv x | wgate x + ape] for each token the call uses (float64
    reference; other rows untouched), and compressor_backward given them returns the bits it
    returns when it computes them itself."""
    (x, wkv, wgate, state, ape), kwargs = make(case, dtype)
    width = 2 * case.coff * case.dim
    kept = torch.full((*x.shape[:-1], width), float("nan"))
    opmesh.compressor(x, wkv, wgate, None if state is None else state.clone(), ape, case.ratio,
                      projections=kept, **kwargs)  # fmt: skip
    xs = x.double().reshape(-1, x.shape[-1])
    rows = kept.reshape(-1, width)
    lengths = case.seqused or case.lengths
    starts = case.start or (0,) * len(case.lengths)
    offsets = (
        [0, *torch.tensor(case.lengths).cumsum(0).tolist()]
        if case.packed
        else [b * (case.lengths[0] if case.lengths else 0) for b in range(len(case.lengths) + 1)]
    )
    used = torch.zeros(rows.shape[0], dtype=torch.bool)
    for b, n in enumerate(lengths):
        idx = torch.arange(offsets[b], offsets[b] + n)
        used[idx] = True
        pos = starts[b] + torch.arange(n)
        want = torch.cat(
            [xs[idx] @ wkv.double().T, xs[idx] @ wgate.double().T + ape.double()[pos % case.ratio]],
            dim=1,
        )
        torch.testing.assert_close(rows[idx].double(), want, atol=2e-5, rtol=2e-5)
    assert rows[~used].isnan().all()
    if case.start is not None and any(case.start):
        return  # the backward refuses entries read from the state
    out = opmesh.compressor(x, wkv, wgate, None, ape, case.ratio, **kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    kw = {k: v for k, v in kwargs.items() if k not in ("state_block_table", "cache_mode")}
    given = torch.ops.opmesh.compressor_backward(grad, x, wkv, wgate, ape, case.ratio,
                                                 projections=kept, **kw)  # fmt: skip
    computed = torch.ops.opmesh.compressor_backward(grad, x, wkv, wgate, ape, case.ratio, **kw)
    for a, b in zip(given, computed, strict=True):
        assert torch.equal(a, b)


def test_autograd_keeps_the_projections_for_the_backward():
    """With a gradient to come the forward fills a projections buffer of its own, and the
    backward reads it; without one no buffer is made."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "compressor" in func.name():
                self.seen.append((func.name(), kwargs.get("projections")))
            return func(*args, **kwargs)

    (x, wkv, wgate, _, ape), kwargs = make(CASES[0])
    leaves = [t.clone().requires_grad_(True) for t in (x, wkv, wgate, ape)]
    with Record() as rec:
        out = opmesh.compressor(leaves[0], leaves[1], leaves[2], None, leaves[3], 4, **kwargs)
        out.sum().backward()
    (fwd, kept), (bwd, read) = rec.seen
    assert (fwd, bwd) == ("opmesh::compressor", "opmesh::compressor_backward")
    assert kept is not None and read is kept
    with Record() as rec, torch.no_grad():
        opmesh.compressor(*leaves[:3], None, leaves[3], 4, **kwargs)
    assert rec.seen == [("opmesh::compressor", None)]


def test_gradcheck_float64():
    case = Case("gc", (7, 7), 3, 2, dim=3, hidden=4, seqused=(7, 5))
    (x, wkv, wgate, _, ape), kwargs = make(case, torch.float64)
    inputs = tuple(t.double().requires_grad_(True) for t in (x, wkv, wgate, ape))

    def f(x, wkv, wgate, ape):
        return opmesh.compressor(x, wkv, wgate, None, ape, 3, **kwargs)

    # float64 inputs compute in float32: eps and tolerances above float32 rounding.
    assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=2e-3, rtol=2e-3)


def test_same_bits_for_any_thread_count():
    case = Case("threads", (40, 40), 4, 2, dim=24, hidden=70)
    (x, wkv, wgate, _, ape), kwargs = make(case)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            leaves = [t.clone().requires_grad_(True) for t in (x, wkv, wgate, ape)]
            out = opmesh.compressor(leaves[0], leaves[1], leaves[2], None, leaves[3], 4, **kwargs)
            results.append([out, *torch.autograd.grad(out.square().sum(), leaves)])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_backward_refuses_entries_read_from_the_state():
    case = Case("hist", (6, 6), 4, 2, start=(5, 0))
    (x, wkv, wgate, state, ape), kwargs = make(case)
    x.requires_grad_(True)
    out = opmesh.compressor(x, wkv, wgate, state, ape, 4, **kwargs)
    assert_raises_named(ValueError, "start_pos", lambda: out.sum().backward())


def test_state_cache_requiring_a_gradient_is_refused():
    case = Case("grad_state", (6,), 4, 1, start=(0,))
    (x, wkv, wgate, state, ape), kwargs = make(case)
    state.requires_grad_(True)
    assert_raises_named(
        ValueError, "state_cache", lambda: opmesh.compressor(x, wkv, wgate, state, ape, 4, **kwargs)
    )


# --- graph mode ----------------------------------------------------------------------------


class Decoder(torch.nn.Module):
    def __init__(self, wkv, wgate, ape):
        super().__init__()
        self.wkv, self.wgate, self.ape = wkv, wgate, ape

    def forward(self, x, state, table, start):
        return opmesh.compressor(x, self.wkv, self.wgate, state, self.ape, 4,
                                 state_block_table=table, start_pos=start, coff=2)  # fmt: skip


def test_compiled_updates_the_state_in_place():
    case = Case("compiled", (9, 9), 4, 2, start=(3, 6))
    (x, wkv, wgate, state, ape), kwargs = make(case)
    module = Decoder(wkv, wgate, ape)
    eager_state = state.clone()
    want = module(x, eager_state, kwargs["state_block_table"], kwargs["start_pos"])
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    got = compiled(x, state, kwargs["state_block_table"], kwargs["start_pos"])
    assert torch.equal(got, want) and torch.equal(state, eager_state)
    # Another token count reuses the graph (dynamic sizes).
    x2 = x[:, :5].contiguous()
    s2, e2 = state.clone(), state.clone()
    start2 = kwargs["start_pos"] + 4
    assert torch.equal(compiled(x2, s2, kwargs["state_block_table"], start2),
                       module(x2, e2, kwargs["state_block_table"], start2))  # fmt: skip
    assert torch.equal(s2, e2)


def test_compiled_training_step():
    case = Case("train", (12, 12), 4, 2)
    (x, wkv, wgate, _, ape), kwargs = make(case)

    def step(x, wkv, wgate, ape):
        return opmesh.compressor(x, wkv, wgate, None, ape, 4, coff=2).square().sum()

    leaves = [t.clone().requires_grad_(True) for t in (x, wkv, wgate, ape)]
    want = torch.autograd.grad(step(*leaves), leaves)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_export_keeps_the_in_place_update():
    case = Case("export", (9, 9), 4, 2, start=(3, 6))
    (x, wkv, wgate, state, ape), kwargs = make(case)
    module = Decoder(wkv, wgate, ape)
    args = (x, state.clone(), kwargs["state_block_table"], kwargs["start_pos"])
    exported = torch.export.export(module, args)
    names = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any("opmesh.compressor" in n for n in names), names
    s_exp, s_eager = state.clone(), state.clone()
    got = exported.module()(x, s_exp, *args[2:])
    want = module(x, s_eager, *args[2:])
    assert torch.equal(got, want) and torch.equal(s_exp, s_eager)


# --- errors --------------------------------------------------------------------------------


def _errors():
    case = Case("err", (8, 8), 4, 2, start=(0, 4))
    (x, wkv, wgate, state, ape), kw = make(case)
    table = kw["state_block_table"]

    def call(**over):
        args = dict(x=x, wkv=wkv, wgate=wgate, state_cache=state.clone(), ape=ape, cmp_ratio=4)
        kwargs = dict(kw)
        for k, v in over.items():
            (args if k in args else kwargs)[k] = v
        return lambda: opmesh.compressor(**args, **kwargs)

    zero_table = table.clone()
    zero_table[1, 0] = 0  # sequence 1 starts at 4: it reads positions 0..3 of block 0
    return [
        ("coff", ValueError, call(coff=3)),
        ("cmp_ratio", ValueError, call(cmp_ratio=0)),
        ("cache_mode", ValueError, call(cache_mode=3)),
        ("x", ValueError, call(x=x[0, 0])),
        ("x", TypeError, call(x=x.int())),
        ("wkv", ValueError, call(wkv=wkv[:, :3])),
        ("wkv", TypeError, call(wkv=wkv.double())),
        ("wgate", ValueError, call(wgate=wgate[:4])),
        ("wkv", ValueError, call(wkv=wkv[:5], wgate=wgate[:5])),
        ("ape", ValueError, call(ape=ape[:3])),
        ("cu_seqlens", ValueError, call(cu_seqlens=torch.tensor([0, 8, 16]))),
        ("cu_seqlens", ValueError, call(x=x.reshape(16, -1), cu_seqlens=torch.tensor([0, 9, 8]))),
        ("cu_seqlens", ValueError, call(x=x.reshape(16, -1), cu_seqlens=torch.tensor([0, 8, 17]))),
        ("cu_seqlens", ValueError, call(x=x.reshape(16, -1))),
        ("seqused", ValueError, call(seqused=torch.tensor([9, 1]))),
        ("seqused", ValueError, call(seqused=torch.tensor([1]))),
        ("start_pos", ValueError, call(start_pos=torch.tensor([-1, 0]))),
        ("start_pos", ValueError, call(state_cache=None, state_block_table=None)),
        ("state_cache", TypeError, call(state_cache=state.double())),
        ("state_cache", ValueError, call(state_cache=state[..., :5])),
        ("state_cache", ValueError, call(state_cache=state[:, :0])),
        ("state_cache", ValueError, call(cache_mode=2, state_block_table=table[:, 0])),
        ("state_block_table", ValueError, call(state_block_table=None)),
        ("state_block_table", ValueError, call(state_block_table=table + 100)),
        ("state_block_table", ValueError, call(state_block_table=table[:, :1])),
        ("state_block_table", ValueError, call(state_block_table=zero_table)),
        ("state_block_table", ValueError, call(state_block_table=table[:1])),
        ("state_block_table", ValueError, call(state_cache=None, start_pos=None)),
        ("projections", TypeError, call(projections=torch.zeros(2, 8, 24, dtype=torch.float64))),
        ("projections", ValueError, call(projections=torch.zeros(2, 8, 23))),
        ("projections", ValueError, call(projections=torch.zeros(16, 24))),
        ("projections", ValueError, call(projections=torch.zeros(2, 24, 8).transpose(1, 2))),
    ]  # fmt: skip


@pytest.mark.parametrize("i", range(len(_errors())))
def test_errors_name_the_argument(i):
    name, exc, fn = _errors()[i]
    assert_raises_named(exc, name, fn)


def test_input_sharing_the_state_memory_is_refused():
    case = Case("overlap", (8,), 4, 1, hidden=12, start=(0,), block_size=8)
    (x, wkv, wgate, state, ape), kwargs = make(case)
    x = state[:1]  # x is the state cache's first block
    assert_raises_named(
        ValueError, "x", lambda: opmesh.compressor(x, wkv, wgate, state, ape, 4, **kwargs)
    )


def test_projections_sharing_an_input_or_the_state_are_refused():
    case = Case("overlap", (8,), 4, 1, hidden=12, start=(0,), block_size=8)
    (x, wkv, wgate, state, ape), kwargs = make(case)
    inside = state[1, :, :12].unsqueeze(0)  # [1, 8, 12]: the first 12 values of block 1's slots
    assert_raises_named(ValueError, "state_cache", lambda: opmesh.compressor(
        x, wkv, wgate, state, ape, 4, projections=inside, **kwargs))  # fmt: skip
    shared = torch.zeros(1, 8, 12)
    assert_raises_named(ValueError, "x", lambda: opmesh.compressor(
        shared[..., :12], wkv, wgate, None, ape, 4, projections=shared))  # fmt: skip


def test_gradient_with_a_bad_shape_is_refused():
    case = Case("bad_grad", (8, 8), 4, 1)
    (x, wkv, wgate, _, ape), kwargs = make(case)
    assert_raises_named(ValueError, "grad_cmp_kv",
                        lambda: torch.ops.opmesh.compressor_backward(torch.zeros(2, 3, 6), x, wkv,
                                                                     wgate, ape, 4))  # fmt: skip
