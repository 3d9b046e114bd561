"""dense_lightning_indexer_grad_kl_loss and its differentiable front against float64 autograd of
the explicit formula (materialised scores, kl_div), on a designed grid: BSND and TND, S2 != S1,
GQA on both attentions, rope and no rope, masks and bands, lengths with empty sequences, dtypes,
every SIMD path; gradcheck; compiled equals eager; errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from comparators import assert_close
from conftest import assert_raises_named
from reference import UNBOUNDED, indexer_kl_loss, indexer_visible, main_attention_stats

import opmesh


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layout: str = "BSND"
    b: int = 1
    s1: int = 70
    s2: int = 70
    n1: int = 4
    n2: int = 2
    d: int = 16
    dr: int = 0
    n1i: int = 4
    n2i: int = 1
    di: int = 8
    lens: tuple | None = None  # BSND: (qlens, klens); TND: (q ends, k ends)
    sparse_mode: int = 3
    pre_tokens: int = UNBOUNDED
    next_tokens: int = UNBOUNDED
    cmp_ratio: int = 1  # compressed keys (DeepSeek-V4), with one residual per sequence
    residuals: tuple | None = None


CASES = [
    Case("causal_square"),
    Case("one_tile", s1=9, s2=9, n1=2, n2=1, d=5, n1i=2, di=3),
    Case("no_mask_s2_longer", s1=37, s2=130, sparse_mode=0),
    Case("causal_s1_longer", s1=100, s2=47, n1=3, n2=3, n1i=2, n2i=2, di=7),
    Case("rope_mla", s1=66, s2=66, n1=4, n2=1, d=12, dr=5, n1i=4, n2i=1, di=16),
    Case("gqa_index_heads", b=2, s1=50, s2=81, n1=6, n2=2, n1i=6, n2i=3, di=9, sparse_mode=0),
    Case("band_causal", s1=140, s2=140, pre_tokens=30),
    Case("band_both_sides", s1=90, s2=120, sparse_mode=0, pre_tokens=20, next_tokens=7),
    Case("bsnd_lengths", b=3, s1=70, s2=75, lens=((70, 0, 33), (75, 40, 0))),
    Case(
        "tnd_varlen",
        layout="TND",
        b=4,
        s1=150,
        s2=170,
        lens=((40, 40, 115, 150), (50, 50, 130, 170)),
    ),
    Case(
        "tnd_rope_band",
        layout="TND",
        b=2,
        s1=100,
        s2=100,
        dr=4,
        lens=((64, 100), (64, 100)),
        pre_tokens=17,
    ),
    # Compressed keys: each key entry stands for cmp_ratio original tokens.
    Case("compressed_bsnd", b=2, s1=41, s2=10, cmp_ratio=4, residuals=(1, 3), dr=4),
    Case(
        "compressed_tnd",
        layout="TND",
        b=3,
        s1=60,
        s2=21,
        lens=((25, 25, 60), (6, 6, 21)),
        cmp_ratio=4,
        residuals=(1, 0, 3),
        n2i=2,
    ),
]


def case_visible(case, b, ql, kl):
    residual = case.residuals[b] if case.residuals else 0
    return indexer_visible(
        ql, kl, case.sparse_mode, case.pre_tokens, case.next_tokens, case.cmp_ratio, residual
    )


def sequences(case):
    """(q_begin, q_len, k_begin, k_len) per sequence."""
    if case.layout == "TND":
        qe, ke = case.lens
        return [
            (
                qe[i - 1] if i else 0,
                qe[i] - (qe[i - 1] if i else 0),
                ke[i - 1] if i else 0,
                ke[i] - (ke[i - 1] if i else 0),
            )
            for i in range(len(qe))
        ]
    if case.lens is None:
        return [(0, case.s1, 0, case.s2)] * case.b
    return [(0, q, 0, k) for q, k in zip(*case.lens, strict=True)]


def make(case, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead_q = (case.s1,) if case.layout == "TND" else (case.b, case.s1)
    lead_k = (case.s2,) if case.layout == "TND" else (case.b, case.s2)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    t = dict(
        query=randn(*lead_q, case.n1, case.d),
        key=randn(*lead_k, case.n2, case.d),
        query_index=randn(*lead_q, case.n1i, case.di),
        key_index=randn(*lead_k, case.n2i, case.di),
        weights=randn(*lead_q, case.n1i, scale=(case.di * case.n1i) ** -0.5),
    )
    if case.dr:
        t["query_rope"] = randn(*lead_q, case.n1, case.dr)
        t["key_rope"] = randn(*lead_k, case.n2, case.dr)
    scale = (case.d + case.dr) ** -0.5
    # The main attention's statistics, exact (float64 on the rounded inputs).
    group = case.n1 // case.n2
    if case.layout == "TND":
        smax = torch.full((case.n2, case.s1, group), float("-inf"), dtype=torch.float64)
    else:
        smax = torch.full((case.b, case.n2, case.s1, group), float("-inf"), dtype=torch.float64)
    ssum = torch.zeros_like(smax)
    for b, (q0, ql, k0, kl) in enumerate(sequences(case)):
        bi = () if case.layout == "TND" else (b,)
        rows = slice(q0, q0 + ql)
        keys = slice(k0, k0 + kl)
        visible = case_visible(case, b, ql, kl)
        rope = {}
        if case.dr:
            rope = dict(
                query_rope=t["query_rope"][bi + (rows,)], key_rope=t["key_rope"][bi + (keys,)]
            )
        m, s = main_attention_stats(
            t["query"][bi + (rows,)], t["key"][bi + (keys,)], scale, visible=visible, **rope
        )
        smax[bi + (slice(None), rows)] = m
        ssum[bi + (slice(None), rows)] = s
    t["softmax_max"] = smax.float()
    t["softmax_sum"] = ssum.float()
    options = dict(layout=case.layout, sparse_mode=case.sparse_mode)
    options.update(pre_tokens=case.pre_tokens, next_tokens=case.next_tokens)
    if case.cmp_ratio > 1:
        options.update(cmp_ratio=case.cmp_ratio, cmp_residual_key=case.residuals)
    if case.lens is not None:
        options.update(actual_seq_qlen=list(case.lens[0]), actual_seq_klen=list(case.lens[1]))
    return t, scale, options


def reference(case, t, scale):
    """float64 loss and gradients (autograd through the explicit formula)."""
    leaves = {n: t[n].double().requires_grad_() for n in ("query_index", "key_index", "weights")}
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
        loss = loss + indexer_kl_loss(
            t["query"][rows],
            t["key"][keys],
            leaves["query_index"][rows],
            leaves["key_index"][keys],
            leaves["weights"][rows],
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


def run_op(t, scale, options):
    idx = dict(options)
    m_i, s_i = opmesh.dense_lightning_indexer_softmax_lse(
        t["query_index"], t["key_index"], t["weights"], **idx
    )
    return opmesh.dense_lightning_indexer_grad_kl_loss(
        t["query"], t["key"], t["query_index"], t["key_index"], t["weights"],
        t["softmax_max"], t["softmax_sum"], m_i, s_i, scale,
        query_rope=t.get("query_rope"), key_rope=t.get("key_rope"), **options,
    )  # fmt: skip


# Float32 accumulation in another order: gradients within 2e-5 of the largest entry (relative);
# half-precision outputs are rounded once more (2^-8 relative for bf16, 2^-11 for fp16).
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (2e-5, 8e-3),
    torch.float16: (2e-5, 1e-3),
}


def check(case, dtype, seed=0):
    t, scale, options = make(case, dtype, seed)
    d_qi, d_ki, d_w, loss = run_op(t, scale, options)
    want_loss, want = reference(case, t, scale)
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
        assert_close(got, ref, atol=rel * float(ref.abs().max()) + 1e-7, rtol=out_rtol, name=name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_grid_float32(case, simd_level):
    check(case, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[9]], ids=lambda c: c.name)
def test_half_inputs(case, dtype):
    check(case, dtype)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 4, 5, 9)], ids=lambda c: c.name)
def test_bf16_on_every_kernel_path(case, simd_level):
    """bf16 inputs: the two score products on the level's bf16-pair kernels where it has them
    (exact products, float32 sums), float32 FMA elsewhere; the same results either way."""
    check(case, torch.bfloat16)


def test_float32_weights_with_bf16_inputs():
    case = CASES[5]
    t, scale, options = make(case, torch.bfloat16)
    t["weights"] = t["weights"].float()
    d_qi, d_ki, d_w, loss = run_op(t, scale, options)
    want_loss, want = reference(case, t, scale)
    assert d_w.dtype == torch.float32 and d_qi.dtype == torch.bfloat16
    assert_close(loss[0], want_loss, atol=1e-5, rtol=2e-5, name="loss")
    assert_close(d_w, want[2], atol=2e-5 * float(want[2].abs().max()), rtol=1e-5, name="d_weights")


def test_target_is_normalised_even_when_the_statistics_are_not_the_main_attentions():
    """Statistics that do not make each head sum to 1 (e.g. a log-sum-exp that includes sinks)
    still give a target that sums to 1 over the keys (L1 normalisation)."""
    case = CASES[0]
    t, scale, options = make(case, torch.float32)
    t["softmax_sum"] = t["softmax_sum"] * torch.linspace(1.0, 3.0, case.n1 // case.n2)
    d_qi, d_ki, d_w, loss = run_op(t, scale, options)
    want_loss, want = reference(case, t, scale)
    assert_close(loss[0], want_loss, atol=1e-5, rtol=2e-5, name="loss")
    for got, ref in zip((d_qi, d_ki, d_w), want, strict=True):
        assert_close(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=1e-5)


def test_flash_attn_lse_with_ones_is_equivalent():
    """The main statistics as flash_attn's log-sum-exp with a sum of ones."""
    case = Case("flash", s1=80, s2=80, n1=4, n2=2)
    t, scale, options = make(case, torch.float32)
    _, lse = opmesh.flash_attn(
        t["query"], t["key"], t["key"], softmax_scale=scale, mask_mode=3, return_softmax_lse=True
    )  # lse [B, N1, S1]
    b, n1, s1 = lse.shape
    lse = lse.reshape(b, case.n2, n1 // case.n2, s1).transpose(2, 3).contiguous()
    t_lse = dict(t, softmax_max=lse, softmax_sum=torch.ones_like(lse))
    got = run_op(t_lse, scale, options)
    want = run_op(t, scale, options)
    for a, b_ in zip(got, want, strict=True):
        assert_close(a, b_, atol=1e-5 * float(b_.abs().max()) + 1e-7, rtol=1e-5)


def test_bitwise_the_same_for_any_thread_count():
    case = CASES[9]
    t, scale, options = make(case, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_op(t, scale, options)
        torch.set_num_threads(max(2, threads))
        many = run_op(t, scale, options)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)


def test_rows_without_keys_have_zero_gradient_and_no_loss():
    case = Case("empty", s1=30, s2=10, n1=2, n2=1, n1i=2)  # rows 0..19 see no key (causal)
    t, scale, options = make(case, torch.float32)
    d_qi, _, d_w, loss = run_op(t, scale, options)
    assert (d_qi[:, :20] == 0).all() and (d_w[:, :20] == 0).all()
    assert (d_qi[:, 20:] != 0).any() and torch.isfinite(loss).all()


def test_differentiable_front_matches_the_operator():
    case = CASES[4]
    t, scale, options = make(case, torch.float32)
    leaves = {n: t[n].clone().requires_grad_() for n in ("query_index", "key_index", "weights")}
    loss = opmesh.indexer_kl_loss(
        leaves["query_index"], leaves["key_index"], leaves["weights"],
        t["query"], t["key"], t["softmax_max"], t["softmax_sum"], scale,
        query_rope=t["query_rope"], key_rope=t["key_rope"], **options,
    )  # fmt: skip
    (2.5 * loss).sum().backward()
    d_qi, d_ki, d_w, want_loss = run_op(t, scale, options)
    assert torch.equal(loss, want_loss)
    for leaf, d in zip(leaves.values(), (d_qi, d_ki, d_w), strict=True):
        torch.testing.assert_close(leaf.grad, 2.5 * d, rtol=1e-6, atol=0)


def test_raw_operator_loss_is_differentiable_in_the_index_inputs():
    case = CASES[1]
    t, scale, options = make(case, torch.float32)
    qi = t["query_index"].clone().requires_grad_()
    m_i, s_i = opmesh.dense_lightning_indexer_softmax_lse(
        qi, t["key_index"], t["weights"], **options
    )
    d_qi, d_ki, d_w, loss = torch.ops.opmesh.dense_lightning_indexer_grad_kl_loss(
        t["query"], t["key"], qi, t["key_index"], t["weights"], t["softmax_max"],
        t["softmax_sum"], m_i, s_i, scale, sparse_mode=3,
    )  # fmt: skip
    assert loss.requires_grad and not d_qi.requires_grad
    (3.0 * loss).sum().backward()
    torch.testing.assert_close(qi.grad, 3.0 * d_qi, rtol=1e-6, atol=0)


def test_gradcheck_through_the_front():
    """float64 inputs compute in float32: finite differences with eps = 1e-3 (the relu's kink is
    avoided by the seed: no index score lies within 1e-2 of 0)."""
    case = Case("small", s1=6, s2=7, n1=2, n2=1, d=4, n1i=2, n2i=1, di=3, sparse_mode=0)
    t, scale, options = make(case, torch.float64, seed=11)
    dots = torch.einsum("bihd,bjgd->bhij", t["query_index"], t["key_index"])
    assert dots.abs().min() > 1e-2, "the seed puts a score at the relu's kink"
    main = {n: t[n] for n in ("query", "key", "softmax_max", "softmax_sum")}

    def f(qi, ki, w):
        return opmesh.indexer_kl_loss(
            qi, ki, w, main["query"], main["key"], main["softmax_max"], main["softmax_sum"],
            scale, **options,
        )  # fmt: skip

    inputs = tuple(t[n].clone().requires_grad_() for n in ("query_index", "key_index", "weights"))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_equals_eager(dynamic):
    case = CASES[9]
    t, scale, options = make(case, torch.float32)
    options = dict(options, actual_seq_qlen=torch.tensor(case.lens[0]))
    options["actual_seq_klen"] = torch.tensor(case.lens[1])

    def step(qi, ki, w):
        loss = opmesh.indexer_kl_loss(
            qi, ki, w, t["query"], t["key"], t["softmax_max"], t["softmax_sum"], scale,
            **options,
        )  # fmt: skip
        loss.sum().backward()
        return loss

    def leaves():
        return [t[n].clone().requires_grad_() for n in ("query_index", "key_index", "weights")]

    eager_in, compiled_in = leaves(), leaves()
    want = step(*eager_in)
    got = torch.compile(step, fullgraph=False, dynamic=dynamic)(*compiled_in)
    assert torch.equal(got, want)
    for a, b in zip(compiled_in, eager_in, strict=True):
        assert torch.equal(a.grad, b.grad)

    def forward_only(qi, ki, w):
        return opmesh.indexer_kl_loss(
            qi, ki, w, t["query"], t["key"], t["softmax_max"], t["softmax_sum"], scale,
            **options,
        )  # fmt: skip

    fwd_in = leaves()
    loss = torch.compile(forward_only, fullgraph=True, dynamic=dynamic)(*fwd_in)
    loss.sum().backward()
    assert torch.equal(loss, want)
    for a, b in zip(fwd_in, eager_in, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_opcheck():
    case = CASES[4]
    t, scale, options = make(case, torch.float32)
    m_i, s_i = opmesh.dense_lightning_indexer_softmax_lse(
        t["query_index"], t["key_index"], t["weights"], **options
    )
    args = (t["query"], t["key"], t["query_index"], t["key_index"], t["weights"],
            t["softmax_max"], t["softmax_sum"], m_i, s_i, scale)  # fmt: skip
    kwargs = dict(query_rope=t["query_rope"], key_rope=t["key_rope"], sparse_mode=3)
    torch.library.opcheck(
        torch.ops.opmesh.dense_lightning_indexer_grad_kl_loss.default,
        args,
        kwargs,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


# -- errors -------------------------------------------------------------------------------


def base_args():
    t, scale, options = make(CASES[1], torch.float32)
    m_i, s_i = opmesh.dense_lightning_indexer_softmax_lse(
        t["query_index"], t["key_index"], t["weights"], **options
    )
    t.update(softmax_max_index=m_i, softmax_sum_index=s_i)
    return t, scale


def call(t, scale, **kwargs):
    names = ("query", "key", "query_index", "key_index", "weights", "softmax_max",
             "softmax_sum", "softmax_max_index", "softmax_sum_index")  # fmt: skip
    return opmesh.dense_lightning_indexer_grad_kl_loss(
        *(t[n] for n in names), scale, query_rope=t.get("query_rope"),
        key_rope=t.get("key_rope"), **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    "change, argument, exc",
    [
        (lambda t: t.update(query=t["query"][:, :5]), "query", ValueError),
        (lambda t: t.update(key=t["key"].double()), "key", TypeError),
        (lambda t: t.update(key=t["key"][:, :5]), "key", ValueError),
        (lambda t: t.update(query=t["query"].int()), "query", TypeError),
        (lambda t: t.update(query_rope=torch.zeros(1, 9, 2, 4)), "key_rope", ValueError),
        (lambda t: t.update(softmax_max=t["softmax_max"][..., :-1, :]), "softmax_max", ValueError),
        (lambda t: t.update(softmax_sum=t["softmax_sum"].double()), "softmax_sum", TypeError),
        (
            lambda t: t.update(softmax_max_index=t["softmax_max_index"][0]),
            "softmax_max_index",
            ValueError,
        ),  # fmt: skip
        (
            lambda t: t.update(softmax_sum_index=t["softmax_sum_index"].half()),
            "softmax_sum_index",
            TypeError,
        ),  # fmt: skip
        (lambda t: t.update(weights=t["weights"][..., :1]), "weights", ValueError),
        (lambda t: t.update(key_index=t["key_index"][..., :2]), "key_index", ValueError),
    ],
)
def test_bad_tensors_are_named(change, argument, exc):
    t, scale = base_args()
    change(t)
    assert_raises_named(exc, argument, lambda: call(t, scale))


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(sparse_mode=4), "sparse_mode"),
        (dict(pre_tokens=-1), "pre_tokens"),
        (dict(next_tokens=-2), "next_tokens"),
        (dict(layout="BNSD"), "layout"),
        (dict(actual_seq_qlen=[10]), "actual_seq_qlen"),
    ],
)
def test_bad_options_are_named(kwargs, argument):
    t, scale = base_args()
    assert_raises_named(ValueError, argument, lambda: call(t, scale, **kwargs))


def test_non_finite_scale_is_named():
    t, scale = base_args()
    assert_raises_named(ValueError, "scale_value", lambda: call(t, float("nan")))


@pytest.mark.parametrize("name", ["query", "softmax_max"])
def test_a_target_that_requires_grad_is_refused(name):
    t, scale = base_args()
    t[name] = t[name].clone().requires_grad_()
    assert_raises_named(ValueError, name, lambda: call(t, scale))
    qi = t["query_index"].clone().requires_grad_()
    assert_raises_named(
        ValueError,
        name,
        lambda: opmesh.indexer_kl_loss(
            qi,
            t["key_index"],
            t["weights"],
            t["query"],
            t["key"],
            t["softmax_max"],
            t["softmax_sum"],
            scale,
        ),  # fmt: skip
    )


# Non-finite values, on both losses: a NaN or an infinity in a row the call reads makes the loss
# and every gradient row it writes NaN; the rows it does not read (a sequence without queries or
# without keys) leave the result as it was. A statistic's max of -inf (or a sum of 0) is a head
# without target mass, not a non-finite input.
KL_OPS = ["dense", "sparse"]


def run_kl(op, case, t, scale, options):
    if op == "dense":
        return run_op(t, scale, options)
    import test_sparse_indexer_kl_loss as sparse

    return sparse.run_op(t, sparse.selection(case, 24), scale, options)


def by_name(name):
    return next(c for c in CASES if c.name == name)


# Where a value is read, and where it is not, in "bsnd_lengths" (batch 0 has queries and keys,
# batch 1 keys only, batch 2 queries only).
READ_AND_UNREAD = {
    "query": ((0, 5, 1, 3), (2, 5, 1, 3)),
    "key": ((0, 70, 0, 2), (1, 7, 0, 2)),
    "query_index": ((0, 69, 3, 0), (2, 0, 3, 0)),
    "key_index": ((0, 0, 0, 7), (1, 39, 0, 7)),
    "weights": ((0, 12, 2), (2, 12, 2)),
    "softmax_max": ((0, 1, 30, 1), (2, 1, 30, 1)),
    "softmax_sum": ((0, 0, 30, 0), (2, 0, 30, 0)),
}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=str)
@pytest.mark.parametrize("name", sorted(READ_AND_UNREAD))
@pytest.mark.parametrize("op", KL_OPS)
def test_a_non_finite_value_read_makes_the_loss_and_the_rows_written_nan(op, name, value):
    if name == "softmax_max" and value == -math.inf:
        pytest.skip("a max of -inf is a head without target mass (the next test)")
    case = by_name("bsnd_lengths")
    t, scale, options = make(case, torch.float32)
    clean = run_kl(op, case, t, scale, options)
    read, unread = READ_AND_UNREAD[name]
    for at, same in ((unread, True), (read, False)):
        changed = dict(t, **{name: t[name].clone()})
        changed[name][at] = value
        got = run_kl(op, case, changed, scale, options)
        if same:
            for a, b in zip(got, clean, strict=True):
                assert torch.equal(a, b)
            continue
        *grads, loss = got
        assert loss.isnan().all()
        for grad, before in zip(grads, clean[:3], strict=True):
            assert grad[0].isnan().all()  # batch 0's rows, all written
            assert torch.equal(grad[1:], before[1:])  # the others: zero, as before
            assert (grad[1:] == 0).all()
    # Through the differentiable front: a NaN loss, and NaN gradients.
    changed = dict(t, **{name: t[name].clone()})
    changed[name][read] = value
    leaves = {n: changed[n].clone().requires_grad_() for n in INDEX}
    front = opmesh.indexer_kl_loss if op == "dense" else opmesh.sparse_indexer_kl_loss
    extra = ()
    if op == "sparse":
        import test_sparse_indexer_kl_loss as sparse

        extra = (sparse.selection(case, 24),)
    loss = front(
        *leaves.values(), changed["query"], changed["key"], *extra,
        changed["softmax_max"], changed["softmax_sum"], scale, **options,
    )  # fmt: skip
    loss.sum().backward()
    assert loss.isnan().all() and all(leaf.grad[0].isnan().all() for leaf in leaves.values())


INDEX = ("query_index", "key_index", "weights")


@pytest.mark.parametrize("stat", ["softmax_max", "softmax_sum"])
@pytest.mark.parametrize("op", KL_OPS)
def test_a_head_without_target_mass_adds_nothing_to_the_target(op, stat):
    """A log-sum-exp of -inf (max -inf, or sum 0) for a head of a row that sees keys: that head's
    probabilities are 0, as the float64 reference takes them."""
    case = by_name("gqa_index_heads")
    t, scale, options = make(case, torch.float32)
    t[stat] = t[stat].clone()
    t[stat][1, 0, 40:44, 1] = -math.inf if stat == "softmax_max" else 0.0
    d_qi, d_ki, d_w, loss = run_kl(op, case, t, scale, options)
    if op == "dense":
        want_loss, want = reference(case, t, scale)
    else:
        import test_sparse_indexer_kl_loss as sparse

        want_loss, want = sparse.reference(case, t, sparse.selection(case, 24), scale)
    assert_close(loss[0], want_loss, atol=1e-5, rtol=2e-5, name="loss")
    for got, ref in zip((d_qi, d_ki, d_w), want, strict=True):
        assert_close(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=1e-5)
