"""Every bad flash_attn / flash_attn_metadata input raises a Python exception naming the
argument, and a metadata tensor planned for other arguments is refused with the argument that
differs."""

import pytest
import torch
from conftest import assert_raises_named
from flash_attn_cases import BY_NAME, make_inputs, metadata_kwargs

import opmesh

g = torch.Generator().manual_seed(0)
Q = torch.randn(2, 5, 4, 8, generator=g)
K = torch.randn(2, 7, 2, 8, generator=g)
V = torch.randn(2, 7, 2, 8, generator=g)
TQ, TK = torch.randn(6, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g)
TND = dict(
    cu_seqlens_q=[0, 2, 6],
    cu_seqlens_kv=[0, 4, 9],
    layout_q="TND",
    layout_kv="TND",
    layout_out="TND",
)
CACHE = torch.randn(6, 4, 2, 8, generator=g)
PAGED = dict(
    layout_kv="PA_BBND",
    block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
    seqused_kv=[5, 8],
)


def fa(q=Q, k=K, v=V, **kw):
    return opmesh.flash_attn(q, k, v, **kw)


def md(**kw):
    args = dict(batch_size=2, max_seqlen_q=5, max_seqlen_kv=7)
    args.update(kw)
    return opmesh.flash_attn_metadata(4, 2, 8, **args)


CASES = {
    # dtype
    "q_int": (TypeError, "q", lambda: fa(Q.int(), K.int(), V.int())),
    "k_dtype_mix": (TypeError, "k", lambda: fa(k=K.bfloat16())),
    "v_dtype_mix": (TypeError, "v", lambda: fa(v=V.half())),
    "sinks_dtype": (TypeError, "sinks", lambda: fa(sinks=torch.zeros(4, dtype=torch.float64))),
    "cu_dtype": (
        TypeError,
        "cu_seqlens_q",
        lambda: fa(TQ, TK, TK, **{**TND, "cu_seqlens_q": torch.tensor([0.0, 2.0, 6.0])}),
    ),
    "block_table_dtype": (
        TypeError,
        "block_table",
        lambda: fa(k=CACHE, v=CACHE, **{**PAGED, "block_table": PAGED["block_table"].long()}),
    ),
    "metadata_dtype": (TypeError, "metadata", lambda: fa(metadata=md().long())),
    # device
    "device_mix": (ValueError, "k", lambda: fa(k=K.to("meta"))),
    "sinks_device": (ValueError, "sinks", lambda: fa(sinks=torch.zeros(4, device="meta"))),
    # layout and rank
    "unknown_layout": (ValueError, "layout_q", lambda: fa(layout_q="SBH")),
    "q_paged": (ValueError, "layout_q", lambda: fa(layout_q="PA_BBND")),
    "q_rank": (ValueError, "q", lambda: fa(Q[0])),
    "k_rank": (ValueError, "k", lambda: fa(k=K[0])),
    "kv_layout_mix": (
        ValueError,
        "layout_kv",
        lambda: fa(layout_kv="BNSD", k=K.transpose(1, 2), v=V.transpose(1, 2)),
    ),
    "out_layout_tnd": (ValueError, "layout_out", lambda: fa(layout_out="TND")),
    "out_layout_for_tnd": (
        ValueError,
        "layout_out",
        lambda: fa(TQ, TK, TK, **{**TND, "layout_out": "BSND"}),
    ),
    "unknown_mask_mode": (ValueError, "mask_mode", lambda: fa(mask_mode=2)),
    "window_without_mode": (ValueError, "win_left", lambda: fa(mask_mode=3, win_left=4)),
    "window_right_without_mode": (ValueError, "win_right", lambda: fa(win_right=0)),
    "window_below_minus_one": (ValueError, "win_left", lambda: fa(mask_mode=4, win_left=-2)),
    # shapes
    "heads_not_multiple": (
        ValueError,
        "k",
        lambda: fa(k=K.repeat(1, 1, 2, 1)[:, :, :3], v=V.repeat(1, 1, 2, 1)[:, :, :3]),
    ),
    "head_dim_mismatch": (ValueError, "k", lambda: fa(k=K[..., :4])),
    "v_heads": (ValueError, "v", lambda: fa(v=V[:, :, :1])),
    "v_seq": (ValueError, "v", lambda: fa(v=V[:, :6])),
    "batch_mismatch": (ValueError, "k", lambda: fa(k=K[:1], v=V[:1])),
    "sinks_shape": (ValueError, "sinks", lambda: fa(sinks=torch.zeros(3))),
    "max_seqlen_vs_shape": (ValueError, "max_seqlen_q", lambda: fa(max_seqlen_q=9)),
    "scale_not_finite": (ValueError, "softmax_scale", lambda: fa(softmax_scale=float("inf"))),
    # lengths
    "cu_for_bsnd": (ValueError, "cu_seqlens_q", lambda: fa(cu_seqlens_q=[0, 5, 10])),
    "cu_missing": (
        ValueError,
        "cu_seqlens_q",
        lambda: fa(TQ, TK, TK, layout_q="TND", layout_kv="TND", layout_out="TND"),
    ),
    "cu_kv_missing": (
        ValueError,
        "cu_seqlens_kv",
        lambda: fa(TQ, TK, TK, **{**TND, "cu_seqlens_kv": None}),
    ),
    "cu_not_monotonic": (
        ValueError,
        "cu_seqlens_q",
        lambda: fa(TQ, TK, TK, **{**TND, "cu_seqlens_q": [0, 7, 6]}),
    ),
    "cu_count_mismatch": (
        ValueError,
        "cu_seqlens_kv",
        lambda: fa(TQ, TK, TK, **{**TND, "cu_seqlens_kv": [0, 9]}),
    ),
    "cu_beyond_tensor": (
        ValueError,
        "cu_seqlens_q",
        lambda: fa(TQ, TK, TK, **{**TND, "cu_seqlens_q": [0, 2, 7]}),
    ),
    "cu_not_from_zero": (
        ValueError,
        "cu_seqlens_kv",
        lambda: fa(TQ, TK, TK, **{**TND, "cu_seqlens_kv": [1, 4, 9]}),
    ),
    "seqused_beyond_s": (ValueError, "seqused_q", lambda: fa(seqused_q=[5, 6])),
    "seqused_negative": (ValueError, "seqused_kv", lambda: fa(seqused_kv=[-1, 3])),
    "seqused_count": (ValueError, "seqused_kv", lambda: fa(seqused_kv=[3])),
    "seqused_rank": (
        ValueError,
        "seqused_q",
        lambda: fa(seqused_q=torch.ones(2, 1, dtype=torch.int32)),
    ),
    "max_seqlen_too_small": (
        ValueError,
        "max_seqlen_q",
        lambda: fa(TQ, TK, TK, max_seqlen_q=3, **TND),
    ),
    # paged
    "block_table_missing": (
        ValueError,
        "block_table",
        lambda: fa(k=CACHE, v=CACHE, **{**PAGED, "block_table": None}),
    ),
    # A block table means a paged cache: the layout that says otherwise is what is wrong.
    "block_table_not_paged": (
        ValueError,
        "layout_kv",
        lambda: fa(block_table=PAGED["block_table"], layout_kv="BSND"),
    ),
    "seqused_kv_missing": (
        ValueError,
        "seqused_kv",
        lambda: fa(k=CACHE, v=CACHE, **{**PAGED, "seqused_kv": None}),
    ),
    "block_out_of_range": (
        ValueError,
        "block_table",
        lambda: fa(
            k=CACHE,
            v=CACHE,
            **{**PAGED, "block_table": torch.tensor([[0, 1], [2, 6]], dtype=torch.int32)},
        ),
    ),
    "block_negative": (
        ValueError,
        "block_table",
        lambda: fa(
            k=CACHE,
            v=CACHE,
            **{**PAGED, "block_table": torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)},
        ),
    ),
    "seqused_beyond_table": (
        ValueError,
        "seqused_kv",
        lambda: fa(k=CACHE, v=CACHE, **{**PAGED, "seqused_kv": [5, 9]}),
    ),
    "block_table_batch": (
        ValueError,
        "block_table",
        lambda: fa(k=CACHE, v=CACHE, **{**PAGED, "block_table": PAGED["block_table"][:1]}),
    ),
    # metadata op
    "md_heads": (
        ValueError,
        "num_heads_kv",
        lambda: opmesh.flash_attn_metadata(4, 3, 8, batch_size=1, max_seqlen_q=1, max_seqlen_kv=1),
    ),
    "md_head_dim": (ValueError, "head_dim_v", lambda: md(head_dim_v=0)),
    "md_workers": (ValueError, "num_workers", lambda: md(num_workers=0)),
    "md_batch": (ValueError, "batch_size", lambda: md(batch_size=-1)),
    "md_max": (ValueError, "max_seqlen_kv", lambda: md(max_seqlen_kv=-5)),
    "md_layout": (ValueError, "layout_kv", lambda: md(layout_kv="NOPE")),
    "md_mask": (ValueError, "mask_mode", lambda: md(mask_mode=1)),
    "md_window": (ValueError, "win_right", lambda: md(mask_mode=0, win_right=3)),
    "md_cu_count": (
        ValueError,
        "cu_seqlens_q",
        lambda: md(
            cu_seqlens_q=[0, 1],
            cu_seqlens_kv=[0, 1, 2],
            layout_q="TND",
            layout_kv="TND",
            layout_out="TND",
        ),
    ),
    "md_cu_max": (
        ValueError,
        "max_seqlen_q",
        lambda: md(
            cu_seqlens_q=[0, 1, 9],
            cu_seqlens_kv=[0, 1, 2],
            layout_q="TND",
            layout_kv="TND",
            layout_out="TND",
        ),
    ),
    "md_paged_lengths": (ValueError, "seqused_kv", lambda: md(layout_kv="PA_BBND")),
    "md_cu_type": (TypeError, "cu_seqlens_kv", lambda: md(cu_seqlens_kv="0,1")),
    # metadata tensor
    "metadata_garbage": (
        ValueError,
        "metadata",
        lambda: fa(metadata=torch.zeros(200, dtype=torch.int32)),
    ),
    "metadata_truncated": (ValueError, "metadata", lambda: fa(metadata=md()[:-1])),
    "metadata_rank": (ValueError, "metadata", lambda: fa(metadata=md().view(1, -1))),
    "describe_garbage": (
        ValueError,
        "metadata",
        lambda: opmesh.describe_metadata(torch.ones(100, dtype=torch.int32)),
    ),
    "describe_dtype": (TypeError, "metadata", lambda: opmesh.describe_metadata(md().float())),
}


HINTS = {
    # layout_q="TND" with the keys stated otherwise: the keys' layout is what to change.
    "tnd_with_bsnd_layout_kv": (
        "layout_kv",
        "must equal layout_q ('TND')",
        lambda: fa(
            TQ,
            TK,
            TK,
            cu_seqlens_q=[0, 2, 6],
            cu_seqlens_kv=[0, 4, 9],
            layout_q="TND",
            layout_kv="BSND",
        ),
    ),  # fmt: skip
    # A 3-D q with the default layout: packed tokens need TND.
    "3d_q_default_layout": ("q", "layout_q='TND'", lambda: fa(TQ, TK, TK)),
    # A 4-D q called TND: a batch needs BSND or BNSD.
    "4d_q_called_tnd": ("q", "layout_q='BSND'", lambda: fa(layout_q="TND", layout_kv="TND")),
    # k read with q's layout (BNSD) while it is BSND: its heads do not divide q's.
    "k_in_another_layout": (
        "k",
        "set layout_kv (or layout_q)",
        lambda: fa(q=Q.transpose(1, 2), layout_q="BNSD", layout_out="BNSD"),
    ),
}


def test_layouts_default_to_q_and_a_block_table_to_paged():
    """What used to need three agreeing layout arguments follows from q's layout and the
    block table."""
    tnd = fa(TQ, TK, TK, cu_seqlens_q=[0, 2, 6], cu_seqlens_kv=[0, 4, 9], layout_q="TND")
    explicit = fa(TQ, TK, TK, cu_seqlens_q=[0, 2, 6], cu_seqlens_kv=[0, 4, 9], layout_q="TND",
                  layout_kv="TND", layout_out="TND")  # fmt: skip
    assert torch.equal(tnd[0], explicit[0])
    paged = fa(k=CACHE, v=CACHE, block_table=PAGED["block_table"], seqused_kv=[5, 8])
    stated = fa(k=CACHE, v=CACHE, block_table=PAGED["block_table"], seqused_kv=[5, 8],
                layout_kv="PA_BBND")  # fmt: skip
    assert torch.equal(paged[0], stated[0])


@pytest.mark.parametrize("name", sorted(HINTS))
def test_error_hints_blame_the_argument_to_change(name):
    argument, hint, fn = HINTS[name]
    error = assert_raises_named(ValueError, argument, fn)
    assert hint in str(error), str(error)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_names_the_argument(name):
    exc, argument, fn = CASES[name]
    assert_raises_named(exc, argument, fn)


def test_tampered_plan_is_refused():
    """Worker ranges that do not tile the work are rejected before any memory is touched."""
    plan = md(num_workers=3, mask_mode=3)
    header = plan.numel() - 16 * 3
    # A worker's begin, its end, the next worker's begin, a continuation slot.
    for index in (header + 0, header + 4, header + 11 + 1, header + 8):
        bad = plan.clone()
        bad[index] += 1
        with pytest.raises(ValueError, match="metadata"):
            fa(metadata=bad)


# Each argument the metadata records: a call that differs only there is refused, naming it.
CASE = BY_NAME["seqused_tnd"]
MISMATCH = {
    "num_heads_q": dict(nq=8),
    "num_heads_kv": dict(nkv=2),
    "head_dim": dict(d=32),
    "head_dim_v": dict(head_dim_v=32),
    "batch_size": dict(case="dense_bsnd", batch_size=3),
    "max_seqlen_q": dict(max_seqlen_q=64, call=dict(max_seqlen_q=40)),
    "max_seqlen_kv": dict(max_seqlen_kv=64, call=dict(max_seqlen_kv=60)),
    "mask_mode": dict(mask_mode=0),
    "win_left": dict(mask_mode=4, win_left=5, call=dict(mask_mode=4, win_left=6)),
    "win_right": dict(mask_mode=4, win_right=5, call=dict(mask_mode=4, win_right=6)),
    "layout_kv": dict(layout_kv="PA_BBND"),
    "layout_q": dict(
        layout_q="BSND",
        layout_kv="BSND",
        layout_out="BSND",
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        max_seqlen_q=40,
        max_seqlen_kv=60,
    ),
    "layout_out": dict(call_layout_out="BNSD"),
    "cu_seqlens_q": dict(cu_seqlens_q=torch.tensor([0, 39, 70], dtype=torch.int32)),
    "cu_seqlens_kv": dict(cu_seqlens_kv=torch.tensor([0, 51, 110], dtype=torch.int32)),
    "seqused_q": dict(seqused_q=torch.tensor([25, 29], dtype=torch.int32)),
    "seqused_kv": dict(seqused_kv=None),
}


@pytest.mark.parametrize("argument", sorted(MISMATCH))
def test_metadata_mismatch_names_the_argument(argument):
    change = dict(MISMATCH[argument])
    case = BY_NAME[change.pop("case", CASE.name)]
    q, k, v, kw = make_inputs(case)
    call_kw = dict(kw)
    call_kw.update(change.pop("call", {}))
    nq = change.pop("nq", case.nq)
    nkv = change.pop("nkv", case.nkv)
    d = change.pop("d", case.d)
    if "call_layout_out" in change:
        # Plan a BSND call with BNSD output: the call's layout_out differs.
        q, k, v, call_kw = make_inputs(BY_NAME["dense_bsnd"])
        planned = metadata_kwargs(BY_NAME["dense_bsnd"], q, call_kw)
        nq, nkv, d = 4, 1, 64
        call_kw["layout_out"] = "BNSD"
    else:
        planned = metadata_kwargs(case, q, kw)
        planned.update(change)
        planned = {key: val for key, val in planned.items() if val is not None}
    if argument == "layout_kv":
        planned["seqused_kv"] = kw["seqused_kv"]
        planned.pop("cu_seqlens_kv")
    metadata = opmesh.flash_attn_metadata(nq, nkv, d, **planned)
    with pytest.raises(ValueError) as info:
        opmesh.flash_attn(q, k, v, metadata=metadata, **call_kw)
    message = str(info.value)
    assert "metadata" in message and argument in message, message
