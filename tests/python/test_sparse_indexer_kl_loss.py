"""sparse_lightning_indexer_grad_kl_loss and its differentiable front sparse_indexer_kl_loss
against float64 autograd of the explicit formula (reference.sparse_indexer_kl_loss: scores
materialised, the selection as a mask, kl_div), on the dense loss's designed grid (BSND and TND,
S2 != S1, GQA on both attentions, rope, masks and bands, lengths with empty sequences) with
selections that are random subsets (entries the mask hides, -1 padding, K beyond the visible
keys, K = 1, one selection for every index key head), dtypes, every SIMD path; the dense loss
when every key is selected; the sparse attention's statistics; gradcheck; graph mode; errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from comparators import assert_close
from conftest import assert_raises_named
from reference import sparse_indexer_kl_loss as reference_loss
from test_indexer_kl_loss import CASES, Case, case_visible, make, sequences

import opmesh

OP = torch.ops.opmesh.sparse_lightning_indexer_grad_kl_loss.default
INDEX_INPUTS = ("query_index", "key_index", "weights")


def selection(case, k, *, shared=False, seed=0, fill=0.6):
    """sparse_indices [B, S1, heads, k] / [T1, heads, k]: per row round(fill * k) entries (at
    most the sequence's keys) are distinct random key positions of the row's sequence, visible
    or not, the rest -1, in random order."""
    g = torch.Generator().manual_seed(1000 + seed)
    heads = 1 if shared else case.n2i
    lead = (case.s1,) if case.layout == "TND" else (case.b, case.s1)
    idx = torch.full((*lead, heads, k), -1, dtype=torch.int32)
    for b, (q0, ql, _k0, kl) in enumerate(sequences(case)):
        bi = () if case.layout == "TND" else (b,)
        for i in range(ql):
            for n in range(heads):
                take = min(kl, max(1, round(fill * k)))
                keys = torch.randperm(kl, generator=g)[:take].to(torch.int32)
                row = torch.full((k,), -1, dtype=torch.int32)
                row[torch.randperm(k, generator=g)[:take]] = keys
                idx[bi + (q0 + i, n)] = row
    return idx


def reference(case, t, idx, scale):
    """float64 loss and gradients (autograd through the explicit formula)."""
    leaves = {n: t[n].double().requires_grad_() for n in INDEX_INPUTS}
    loss = torch.zeros((), dtype=torch.float64)
    for b, (q0, ql, k0, kl) in enumerate(sequences(case)):
        if ql == 0 or kl == 0:
            continue
        bi = () if case.layout == "TND" else (b,)
        rows = bi + (slice(q0, q0 + ql),)
        keys = bi + (slice(k0, k0 + kl),)
        stats_rows = bi + (slice(None), slice(q0, q0 + ql))
        rope = {}
        if case.dr:
            rope = dict(query_rope=t["query_rope"][rows], key_rope=t["key_rope"][keys])
        visible = case_visible(case, b, ql, kl)
        loss = loss + reference_loss(
            t["query"][rows],
            t["key"][keys],
            leaves["query_index"][rows],
            leaves["key_index"][keys],
            leaves["weights"][rows],
            idx[rows],
            t["softmax_max"][stats_rows],
            t["softmax_sum"][stats_rows],
            scale,
            visible=visible,
            **rope,
        )
    if not loss.requires_grad:  # no sequence has a query and a key
        return loss, [torch.zeros_like(x) for x in leaves.values()]
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    grads = [
        torch.zeros_like(x) if gr is None else gr
        for gr, x in zip(grads, leaves.values(), strict=True)
    ]
    return loss, grads


def run_op(t, idx, scale, options):
    return opmesh.sparse_lightning_indexer_grad_kl_loss(
        t["query"], t["key"], t["query_index"], t["key_index"], t["weights"], idx,
        t["softmax_max"], t["softmax_sum"], scale,
        query_rope=t.get("query_rope"), key_rope=t.get("key_rope"), **options,
    )  # fmt: skip


# As for the dense loss: float32 sums in another order, half outputs rounded once more.
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (2e-5, 8e-3),
    torch.float16: (2e-5, 1e-3),
}


def check(case, dtype, k, *, shared=False, seed=0, fill=0.6):
    t, scale, options = make(case, dtype, seed)
    idx = selection(case, k, shared=shared, seed=seed, fill=fill)
    return compare(case, dtype, t, idx, scale, options)


def compare(case, dtype, t, idx, scale, options):
    """The operator on the tensors ``t`` against float64; ``dtype`` picks the tolerance."""
    d_qi, d_ki, d_w, loss = run_op(t, idx, scale, options)
    want_loss, want = reference(case, t, idx, scale)
    assert loss.shape == (1,) and loss.dtype == torch.float32
    assert_close(loss[0], want_loss, atol=1e-5, rtol=2e-5, name="loss")
    rel, out_rtol = TOLERANCES[dtype]
    for name, got, ref, like in zip(
        ("d_query_index", "d_key_index", "d_weights"),
        (d_qi, d_ki, d_w),
        want,
        (t["query_index"], t["key_index"], t["weights"]),
        strict=True,
    ):
        assert got.dtype == like.dtype and got.shape == like.shape, name
        scale_of = float(ref.abs().max())
        assert_close(got, ref, atol=rel * scale_of + 1e-7, rtol=out_rtol, name=name)
    return loss


# Per case: K (some beyond the visible keys, one of 1) and whether one selection serves every
# index key head.
GRID = {
    "causal_square": (24, False),
    "one_tile": (16, False),  # K beyond every sequence's keys
    "no_mask_s2_longer": (1, False),
    "causal_s1_longer": (20, True),
    "rope_mla": (70, False),  # more than one 64-key chunk per row
    "gqa_index_heads": (30, False),
    "band_causal": (40, True),
    "band_both_sides": (33, False),
    "bsnd_lengths": (17, False),
    "tnd_varlen": (25, False),
    "tnd_rope_band": (12, True),
    "compressed_bsnd": (9, False),
    "compressed_tnd": (6, True),
}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_grid_float32(case):
    k, shared = GRID[case.name]
    check(case, torch.float32, k, shared=shared)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [CASES[4], CASES[9]], ids=lambda c: c.name)
def test_every_kernel_path(case, simd_level, dtype):
    """bf16 inputs: the score products and the index gradients' products on the level's bf16-pair
    kernels where it has them."""
    k, shared = GRID[case.name]
    check(case, dtype, k, shared=shared, seed=1)


def test_main_keys_read_in_place_on_every_kernel_path(simd_level):
    """bf16 main keys (and an even rope) of unit stride are read where they lie on pair sets;
    keys of stride 2 are copied and packed first. Both against float64; without a rope, the same
    loss and gradients bit for bit."""
    case = Case("in_place", s1=40, s2=75, n1=4, n2=2, d=16, n1i=4, n2i=1, di=8)
    check(case, torch.bfloat16, 70)
    check(dataclasses.replace(case, name="in_place_rope", dr=6), torch.bfloat16, 70)
    assert_same_bits_strided(case, "key", 70)


def assert_same_bits_strided(case, name, k):
    """The operator on bf16 inputs equals itself bit for bit with input ``name`` as a stride-2
    view of the same values."""
    t, scale, options = make(case, torch.bfloat16, 0)
    idx = selection(case, k)
    x = t[name]
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=torch.bfloat16)
    wide[..., ::2] = x
    strided = dict(t, **{name: wide[..., ::2]})
    assert strided[name].stride(-1) == 2
    for a, b in zip(
        run_op(t, idx, scale, options), run_op(strided, idx, scale, options), strict=True
    ):
        assert torch.equal(a, b)


def test_index_keys_read_in_place_on_every_kernel_path(simd_level):
    """bf16 index keys of unit stride whose rows fill whole pair words are read where they lie on
    pair sets; keys of stride 2 are copied and packed first. Against float64, and the same loss
    and gradients bit for bit; an odd index dim (a padded pair word) takes the copy too."""
    case = Case("index_in_place", s1=40, s2=75, n1=4, n2=2, d=16, n1i=6, n2i=2, di=8)
    for di in (8, 7):
        shaped = dataclasses.replace(case, di=di)
        check(shaped, torch.bfloat16, 70)
        assert_same_bits_strided(shaped, "key_index", 70)


def test_bf16_index_inputs_with_float32_weights_on_every_kernel_path(simd_level):
    """bf16 index inputs take the pair products; float32 weights that are not bf16 values make
    the key pass form float32 coefficients (two bf16 halves), bf16-valued ones let the signs
    select the weights (one product): both against float64, 70 heads (two blocks of 64)."""
    case = Case("float32_weights", s1=30, s2=40, n1=2, n2=1, d=8, n1i=70, n2i=1, di=10)
    t, scale, options = make(case, torch.bfloat16, 2)
    idx = selection(case, 40)
    rounded = t["weights"].float()
    assert torch.equal(rounded.bfloat16().float(), rounded)
    g = torch.Generator().manual_seed(5)
    general = rounded * (1 + 0.3 * torch.rand(rounded.shape, generator=g))
    assert not torch.equal(general.bfloat16().float(), general)
    for weights in (general, rounded):
        compare(case, torch.bfloat16, dict(t, weights=weights), idx, scale, options)


def test_an_odd_index_group_wider_than_128_heads_on_every_kernel_path(simd_level):
    """On pairs the key pass takes the index heads as its depth, 128 at a time: 131 heads (odd)
    take two products, the second over a half-empty pair; K = 70 takes two key chunks."""
    case = Case("odd_wide_group", s1=20, s2=26, n1=2, n2=1, d=8, n1i=131, n2i=1, di=10)
    check(case, torch.bfloat16, 70)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[9]], ids=lambda c: c.name)
def test_half_inputs(case, dtype):
    k, shared = GRID[case.name]
    check(case, dtype, k, shared=shared)


def test_more_than_64_index_heads_per_key_head():
    """Groups wider than one 64-row block take the other transpose in the key pass."""
    case = Case("wide_group", s1=20, s2=26, n1=2, n2=1, d=8, n1i=80, n2i=1, di=8)
    check(case, torch.float32, 12)


def test_every_key_selected_is_the_dense_loss():
    """With every key of the sequence listed, the sparse loss is the dense one."""
    case = CASES[5]  # GQA on both attentions, S2 > S1, no mask
    t, scale, options = make(case, torch.float32)
    lead = (case.b, case.s1, 1)
    idx = torch.arange(case.s2 - 1, -1, -1, dtype=torch.int32).expand(*lead, case.s2).contiguous()
    sparse = run_op(t, idx, scale, options)
    m_i, s_i = opmesh.dense_lightning_indexer_softmax_lse(
        t["query_index"], t["key_index"], t["weights"], **options
    )
    dense = opmesh.dense_lightning_indexer_grad_kl_loss(
        t["query"], t["key"], t["query_index"], t["key_index"], t["weights"],
        t["softmax_max"], t["softmax_sum"], m_i, s_i, scale, **options,
    )  # fmt: skip
    for a, b in zip(sparse, dense, strict=True):
        assert_close(a, b, atol=2e-5 * float(b.abs().max()) + 1e-7, rtol=1e-5)


def test_with_the_sparse_attentions_statistics():
    """The DSA sparse stage: the main attention through sparse_flash_attention on the indexer's
    top-k, its statistics fed to the loss."""
    case = dataclasses.replace(CASES[4], name="mla", n1=8, s1=90, s2=90)
    t, scale, options = make(case, torch.float32, seed=3)
    idx, _ = opmesh.lightning_indexer(
        t["query_index"], t["key_index"], t["weights"], sparse_count=24
    )
    _, smax, ssum = opmesh.sparse_flash_attention(
        t["query"], t["key"], t["key"], idx, scale, query_rope=t["query_rope"],
        key_rope=t["key_rope"], return_softmax_lse=True, attention_mode=2,
    )  # fmt: skip
    t.update(softmax_max=smax, softmax_sum=ssum)
    d_qi, d_ki, d_w, loss = run_op(t, idx, scale, options)
    want_loss, want = reference(case, t, idx, scale)
    assert_close(loss[0], want_loss, atol=1e-5, rtol=2e-5, name="loss")
    for got, ref in zip((d_qi, d_ki, d_w), want, strict=True):
        assert_close(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=1e-5)


def test_bitwise_the_same_for_any_thread_count():
    case = CASES[9]
    t, scale, options = make(case, torch.float32)
    idx = selection(case, 25)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_op(t, idx, scale, options)
        torch.set_num_threads(max(2, threads))
        many = run_op(t, idx, scale, options)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)


def test_rows_that_select_nothing_have_zero_gradient_and_no_loss():
    case = CASES[0]
    t, scale, options = make(case, torch.float32)
    idx = selection(case, 8)
    idx[:, :30] = -1  # rows 0..29 select nothing
    idx[:, 30:40] = -1
    idx[:, 30:40, :, 3] = 69  # rows 30..39 select only a key they cannot see
    d_qi, _, d_w, loss = run_op(t, idx, scale, options)
    assert (d_qi[:, :40] == 0).all() and (d_w[:, :40] == 0).all()
    assert (d_qi[:, 40:] != 0).any() and torch.isfinite(loss).all()
    want_loss, _ = reference(case, t, idx, scale)
    assert_close(loss[0], want_loss, atol=1e-5, rtol=2e-5, name="loss")


def test_int64_indices_equal_int32():
    case = CASES[1]
    t, scale, options = make(case, torch.float32)
    idx = selection(case, 16)
    narrow, wide = run_op(t, idx, scale, options), run_op(t, idx.long(), scale, options)
    for a, b in zip(narrow, wide, strict=True):
        assert torch.equal(a, b)


def test_differentiable_front_matches_the_operator():
    case = CASES[4]
    t, scale, options = make(case, torch.float32)
    idx = selection(case, 30)
    leaves = {n: t[n].clone().requires_grad_() for n in INDEX_INPUTS}
    loss = opmesh.sparse_indexer_kl_loss(
        leaves["query_index"], leaves["key_index"], leaves["weights"], t["query"], t["key"], idx,
        t["softmax_max"], t["softmax_sum"], scale, query_rope=t["query_rope"],
        key_rope=t["key_rope"], **options,
    )  # fmt: skip
    (2.5 * loss).sum().backward()
    d_qi, d_ki, d_w, want_loss = run_op(t, idx, scale, options)
    assert torch.equal(loss, want_loss)
    for leaf, d in zip(leaves.values(), (d_qi, d_ki, d_w), strict=True):
        torch.testing.assert_close(leaf.grad, 2.5 * d, rtol=1e-6, atol=0)


def test_raw_operator_loss_is_differentiable_in_the_index_inputs():
    case = CASES[1]
    t, scale, options = make(case, torch.float32)
    idx = selection(case, 5)
    ki = t["key_index"].clone().requires_grad_()
    d_qi, d_ki, d_w, loss = OP(
        t["query"], t["key"], t["query_index"], ki, t["weights"], idx, t["softmax_max"],
        t["softmax_sum"], scale,
    )  # fmt: skip
    assert loss.requires_grad and not d_ki.requires_grad
    (3.0 * loss).sum().backward()
    torch.testing.assert_close(ki.grad, 3.0 * d_ki, rtol=1e-6, atol=0)


def test_gradcheck_through_the_front():
    """float64 inputs compute in float32: finite differences with eps = 1e-3 (the seed keeps
    every index score away from the relu's kink)."""
    case = Case("small", s1=6, s2=9, n1=2, n2=1, d=4, n1i=2, n2i=1, di=3, sparse_mode=0)
    t, scale, options = make(case, torch.float64, seed=11)
    dots = torch.einsum("bihd,bjgd->bhij", t["query_index"], t["key_index"])
    assert dots.abs().min() > 1e-2, "the seed puts a score at the relu's kink"
    idx = selection(case, 5, seed=11)

    def f(qi, ki, w):
        return opmesh.sparse_indexer_kl_loss(
            qi, ki, w, t["query"], t["key"], idx, t["softmax_max"], t["softmax_sum"], scale,
            **options,
        )  # fmt: skip

    inputs = tuple(t[n].clone().requires_grad_() for n in INDEX_INPUTS)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_equals_eager(dynamic):
    torch._dynamo.reset()

    def step(qi, ki, w, t, idx, scale, options):
        return opmesh.sparse_indexer_kl_loss(
            qi, ki, w, t["query"], t["key"], idx, t["softmax_max"], t["softmax_sum"], scale,
            **options,
        )  # fmt: skip

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for case in (
        CASES[9],
        dataclasses.replace(CASES[9], s1=120, s2=140, lens=((60, 120), (70, 140))),
    ):
        t, scale, options = make(case, torch.float32)
        options = dict(options, actual_seq_qlen=torch.tensor(case.lens[0]))
        options["actual_seq_klen"] = torch.tensor(case.lens[1])
        idx = selection(case, 25)
        results = []
        for fn in (step, compiled):
            leaves = [t[n].clone().requires_grad_() for n in INDEX_INPUTS]
            loss = fn(*leaves, t, idx, scale, options)
            loss.sum().backward()
            results.append((loss, [x.grad for x in leaves]))
        (want, want_g), (got, got_g) = results
        assert torch.equal(got, want)
        for a, b in zip(got_g, want_g, strict=True):
            assert torch.equal(a, b)


def test_export_with_a_dynamic_sequence_length():
    class Loss(torch.nn.Module):
        def forward(self, q, k, qi, ki, w, idx, smax, ssum):
            return OP(q, k, qi, ki, w, idx, smax, ssum, 0.25)[3]

    def inputs(s):
        case = dataclasses.replace(CASES[0], s1=s, s2=s)
        t, _, _ = make(case, torch.float32)
        idx = selection(case, 8)
        names = ("query", "key", "query_index", "key_index", "weights")
        return (*(t[n] for n in names), idx, t["softmax_max"], t["softmax_sum"])

    s = torch.export.Dim("s", min=2)
    shapes = ({1: s}, {1: s}, {1: s}, {1: s}, {1: s}, {1: s}, {2: s}, {2: s})
    program = torch.export.export(Loss(), inputs(40), dynamic_shapes=shapes)
    for args in (inputs(40), inputs(57)):
        assert torch.equal(program.module()(*args), Loss()(*args))


def test_opcheck():
    case = CASES[4]
    t, scale, options = make(case, torch.float32)
    idx = selection(case, 20)
    args = (t["query"], t["key"], t["query_index"], t["key_index"], t["weights"], idx,
            t["softmax_max"], t["softmax_sum"], scale)  # fmt: skip
    kwargs = dict(query_rope=t["query_rope"], key_rope=t["key_rope"], sparse_mode=3)
    torch.library.opcheck(
        OP, args, kwargs, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
    )


# -- errors -------------------------------------------------------------------------------


def base():
    case = CASES[1]  # one_tile: s1 = s2 = 9, n2i = 1
    t, scale, options = make(case, torch.float32)
    return t, selection(case, 6), scale


def call(t, idx, scale, **kwargs):
    return run_op(t, idx, scale, kwargs)


def test_bad_sparse_indices_name_the_row():
    t, idx, scale = base()
    for value in (-2, 9):
        bad = idx.clone()
        bad[0, 3, 0, 2] = value
        err = assert_raises_named(ValueError, "sparse_indices", lambda b=bad: call(t, b, scale))
        assert "row [0, 3, 0]" in str(err)
    twice = idx.clone()
    twice[0, 3, 0, 0] = twice[0, 3, 0, 1] = 5
    err = assert_raises_named(ValueError, "sparse_indices", lambda: call(t, twice, scale))
    assert "twice" in str(err)
    # An int64 entry that int32 would wrap onto a valid position.
    wrapped = idx.long()
    wrapped[0, 3, 0, 2] = 2**32 + 1
    assert_raises_named(ValueError, "sparse_indices", lambda: call(t, wrapped, scale))


@pytest.mark.parametrize(
    "change, argument, exc",
    [
        (lambda t, i: t.update(query=t["query"][:, :5]), "query", ValueError),
        (lambda t, i: t.update(key=t["key"].double()), "key", TypeError),
        (lambda t, i: t.update(softmax_max=t["softmax_max"][..., :-1, :]), "softmax_max",
         ValueError),
        (lambda t, i: t.update(softmax_sum=t["softmax_sum"].double()), "softmax_sum", TypeError),
        (lambda t, i: t.update(key_index=t["key_index"][..., :2]), "key_index", ValueError),
        (lambda t, i: t.update(idx=i.float()), "sparse_indices", TypeError),
        (lambda t, i: t.update(idx=i[:, :4]), "sparse_indices", ValueError),
        (lambda t, i: t.update(idx=i.expand(-1, -1, 2, -1)), "sparse_indices", ValueError),
        (lambda t, i: t.update(idx=i[0]), "sparse_indices", ValueError),
    ],
)  # fmt: skip
def test_bad_tensors_are_named(change, argument, exc):
    t, idx, scale = base()
    change(t, idx)
    idx = t.pop("idx", idx)
    assert_raises_named(exc, argument, lambda: call(t, idx, scale))


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(sparse_mode=4), "sparse_mode"),
        (dict(pre_tokens=-1), "pre_tokens"),
        (dict(layout="BNSD"), "layout"),
        (dict(actual_seq_qlen=[10]), "actual_seq_qlen"),
    ],
)
def test_bad_options_are_named(kwargs, argument):
    t, idx, scale = base()
    assert_raises_named(ValueError, argument, lambda: call(t, idx, scale, **kwargs))


def test_non_finite_scale_is_named():
    t, idx, _ = base()
    assert_raises_named(ValueError, "scale_value", lambda: call(t, idx, float("inf")))


@pytest.mark.parametrize("name", ["key", "softmax_sum"])
def test_a_target_that_requires_grad_is_refused(name):
    t, idx, scale = base()
    t[name] = t[name].clone().requires_grad_()
    assert_raises_named(ValueError, name, lambda: call(t, idx, scale))
    qi = t["query_index"].clone().requires_grad_()
    assert_raises_named(
        ValueError,
        name,
        lambda: opmesh.sparse_indexer_kl_loss(
            qi, t["key_index"], t["weights"], t["query"], t["key"], idx, t["softmax_max"],
            t["softmax_sum"], scale,
        ),
    )  # fmt: skip
