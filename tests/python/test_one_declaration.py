"""Each operator's arguments are declared once (csrc/common/op_defs.h): the registered schemas,
the Python functions' defaults and the MindSpore binding's keyword arguments all come from it.
These tests pin what the declaration produces and that the public functions agree with it."""

import inspect

import pytest
import torch

import opmesh
from opmesh import _schema

# Schemas written out by hand: the declaration must produce exactly these names, kinds, defaults,
# alias annotations and keyword-only markers.
EXPECTED = {
    "dense_lightning_indexer_softmax_lse": (
        "(Tensor query_index, Tensor key_index, Tensor weights, *, Tensor? actual_seq_qlen=None, "
        'Tensor? actual_seq_klen=None, str layout="BSND", int sparse_mode=3, '
        "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, "
        "int cmp_ratio=1, Tensor? cmp_residual_key=None) -> "
        "(Tensor softmax_max, Tensor softmax_sum)"
    ),
    "lightning_indexer": (
        "(Tensor query, Tensor key, Tensor weights, *, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, "
        'str layout_query="BSND", str layout_key="BSND", int sparse_count=2048, '
        "int sparse_mode=3, int pre_tokens=9223372036854775807, "
        "int next_tokens=9223372036854775807, bool return_value=False, "
        "float scale_value=1., int cmp_ratio=1, Tensor? cmp_residual_key=None) -> "
        "(Tensor sparse_indices, Tensor sparse_values)"
    ),
    "sparse_lightning_indexer_grad_kl_loss": (
        "(Tensor query, Tensor key, Tensor query_index, Tensor key_index, Tensor weights, "
        "Tensor sparse_indices, Tensor softmax_max, Tensor softmax_sum, float scale_value, *, "
        "Tensor? query_rope=None, Tensor? key_rope=None, Tensor? actual_seq_qlen=None, "
        'Tensor? actual_seq_klen=None, str layout="BSND", int sparse_mode=3, '
        "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, "
        "int cmp_ratio=1, Tensor? cmp_residual_key=None) -> "
        "(Tensor d_query_index, Tensor d_key_index, Tensor d_weights, Tensor loss)"
    ),
    "sparse_flash_mla": (
        "(Tensor q, *, Tensor? ori_kv=None, Tensor? cmp_kv=None, Tensor? ori_sparse_indices=None, "
        "Tensor? cmp_sparse_indices=None, Tensor? ori_block_table=None, "
        "Tensor? cmp_block_table=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, "
        "Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, Tensor? seqused_ori_kv=None, "
        "Tensor? seqused_cmp_kv=None, Tensor? cmp_residual_kv=None, Tensor? ori_topk_length=None, "
        "Tensor? cmp_topk_length=None, Tensor? sinks=None, Tensor? metadata=None, "
        "float softmax_scale=1., int cmp_ratio=1, int ori_mask_mode=4, int cmp_mask_mode=3, "
        'int ori_win_left=-1, int ori_win_right=-1, str layout_q="BSND", str layout_kv="BSND", '
        "int topk_value_mode=1, bool return_softmax_lse=False, Tensor? ori_kv_scale=None, "
        "Tensor? cmp_kv_scale=None) -> (Tensor attention_out, Tensor softmax_lse)"
    ),
    "sparse_flash_mla_backward": (
        "(Tensor dout, Tensor q, Tensor attention_out, Tensor softmax_lse, *, Tensor? dlse=None, "
        "Tensor? ori_kv=None, Tensor? cmp_kv=None, Tensor? ori_sparse_indices=None, "
        "Tensor? cmp_sparse_indices=None, Tensor? ori_block_table=None, "
        "Tensor? cmp_block_table=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, "
        "Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, Tensor? seqused_ori_kv=None, "
        "Tensor? seqused_cmp_kv=None, Tensor? cmp_residual_kv=None, Tensor? ori_topk_length=None, "
        "Tensor? cmp_topk_length=None, Tensor? sinks=None, float softmax_scale=1., "
        "int cmp_ratio=1, int ori_mask_mode=4, int cmp_mask_mode=3, int ori_win_left=-1, "
        'int ori_win_right=-1, str layout_q="BSND", str layout_kv="BSND", int topk_value_mode=1) '
        "-> (Tensor d_q, Tensor d_ori_kv, Tensor d_cmp_kv, Tensor d_sinks)"
    ),
    "sparse_flash_mla_metadata": (
        "(int num_heads_q, int num_heads_kv, int head_dim, *, Tensor? cu_seqlens_q=None, "
        "Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, "
        "Tensor? seqused_ori_kv=None, Tensor? seqused_cmp_kv=None, Tensor? cmp_residual_kv=None, "
        "Tensor? ori_topk_length=None, Tensor? cmp_topk_length=None, int batch_size=0, "
        "int max_seqlen_q=0, int max_seqlen_ori_kv=0, int max_seqlen_cmp_kv=0, int ori_topk=0, "
        "int cmp_topk=0, int cmp_ratio=1, int ori_mask_mode=0, int cmp_mask_mode=0, "
        'int ori_win_left=-1, int ori_win_right=-1, str layout_q="BSND", str layout_kv="BSND", '
        "bool has_ori_kv=True, bool has_cmp_kv=True, int? num_workers=None) -> Tensor"
    ),
    "compressor": (
        "(Tensor x, Tensor wkv, Tensor wgate, Tensor(a!) state_cache, Tensor ape, int cmp_ratio, "
        "*, Tensor? state_block_table=None, Tensor? cu_seqlens=None, Tensor? seqused=None, "
        "Tensor? start_pos=None, int coff=1, int cache_mode=1, Tensor(b!)? projections=None) -> "
        "Tensor"
    ),
    "compressor_backward": (
        "(Tensor grad_cmp_kv, Tensor x, Tensor wkv, Tensor wgate, Tensor ape, int cmp_ratio, *, "
        "Tensor? cu_seqlens=None, Tensor? seqused=None, Tensor? start_pos=None, int coff=1, "
        "Tensor? projections=None) -> (Tensor d_x, Tensor d_wkv, Tensor d_wgate, Tensor d_ape)"
    ),
    "kv_cache_write_": (
        "(Tensor key, Tensor? value, Tensor(a!) key_cache, Tensor(b!)? value_cache, "
        "Tensor slot_mapping, *, Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()"
    ),
    "merge_attn_states": (
        '(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, *, str layout="BSND") -> '
        "(Tensor out, Tensor lse)"
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_schema_is_generated_from_the_declaration(name):
    schema = str(getattr(torch.ops.opmesh, name).default._schema)
    assert schema == f"opmesh::{name}{EXPECTED[name]}"


def test_every_operator_has_a_schema_read_by_python():
    assert set(_schema._POSITIONAL) == {
        "dense_lightning_indexer_softmax_lse",
        "dense_lightning_indexer_grad_kl_loss",
        "flash_attn_metadata",
        "flash_attn",
        "flash_attn_backward",
        "kv_cache_write_",
        "compressor",
        "compressor_backward",
        "merge_attn_states",
        "lightning_indexer",
        "sparse_flash_attention",
        "sparse_flash_attention_backward",
        "sparse_flash_mla",
        "sparse_flash_mla_backward",
        "sparse_flash_mla_metadata",
        "sparse_lightning_indexer_grad_kl_loss",
    }
    assert _schema.positional("flash_attn") == ("q", "k", "v")
    assert _schema.defaults("dense_lightning_indexer_grad_kl_loss")["scale_value"] == 1.0
    assert _schema.UNBOUNDED == 2**63 - 1
    assert _schema.MAX_TOKENS == 2**31 - 256


# Public defaults that differ from the operator's on purpose: the public function derives them
# (layout_kv and layout_out follow layout_q; a block_table implies PA_BBND).
DERIVED = {"layout_kv", "layout_out"}
# Public defaults of None that stand for the operator's default (the argument is left out of the
# call): under dynamic shapes Dynamo traces a float default as a symbolic float, and a guard on
# it makes Dynamo restart its analysis.
LEFT_OUT = {"softcap"}


@pytest.mark.parametrize(
    "function, op",
    [
        (opmesh.dense_lightning_indexer_softmax_lse, "dense_lightning_indexer_softmax_lse"),
        (opmesh.dense_lightning_indexer_grad_kl_loss, "dense_lightning_indexer_grad_kl_loss"),
        (opmesh.indexer_kl_loss, "dense_lightning_indexer_grad_kl_loss"),
        (opmesh.flash_attn, "flash_attn"),
        (opmesh.flash_attn_metadata, "flash_attn_metadata"),
        (opmesh.merge_attn_states, "merge_attn_states"),
        (opmesh.lightning_indexer, "lightning_indexer"),
        (opmesh.sparse_flash_attention, "sparse_flash_attention"),
        (opmesh.sparse_flash_mla, "sparse_flash_mla"),
        (opmesh.sparse_flash_mla_metadata, "sparse_flash_mla_metadata"),
        (opmesh.compressor, "compressor"),
        (opmesh.sparse_lightning_indexer_grad_kl_loss, "sparse_lightning_indexer_grad_kl_loss"),
        (opmesh.sparse_indexer_kl_loss, "sparse_lightning_indexer_grad_kl_loss"),
    ],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_public_defaults_are_the_operators(function, op):
    schema_defaults = _schema.defaults(op)
    checked = 0
    for name, param in inspect.signature(function).parameters.items():
        if name in DERIVED or param.default is inspect.Parameter.empty:
            continue
        if name in LEFT_OUT:
            assert param.default is None and name in schema_defaults, name
            continue
        if name in schema_defaults:
            assert param.default == schema_defaults[name], name
            checked += 1
    assert checked >= 1


def test_calls_leave_out_the_arguments_that_equal_their_default():
    """An eager call passes the operator only what differs from the schema's defaults (each
    keyword costs argument parsing); a value of another type than the default's, or a tensor,
    is always passed."""
    t = torch.zeros(1)
    kwargs = {
        "block_table": None,  # default None: left out
        "sinks": t,  # a tensor where the default is None: passed
        "softcap": 0.0,  # the default: left out
        "mask_mode": 3,  # not the default: passed
        "win_left": -1,  # the default: left out
        "layout_q": "TND",  # not the default: passed
        "layout_kv": "BSND",  # the default: left out
        "return_softmax_lse": True,  # not the default: passed
        "max_seqlen_q": 0,  # an int where the default is None: passed
    }
    kept = _schema.without_defaults("flash_attn", kwargs)
    assert list(kept) == ["sinks", "mask_mode", "layout_q", "return_softmax_lse", "max_seqlen_q"]
    assert kept["sinks"] is t
    # A float default compared with an int of the same value: different types, passed.
    assert _schema.without_defaults("flash_attn", {"softcap": 0}) == {"softcap": 0}
    # None where the default is a number, and a parameter without a default: passed (the
    # operator refuses or takes them itself).
    assert _schema.without_defaults("flash_attn", {"softcap": None}) == {"softcap": None}
    assert _schema.without_defaults("flash_attn", {"q": None, "k": t}) == {"q": None, "k": t}


# The public functions that are one operator each: their parameters are the schema's, in its
# order, with its keyword-only marker. flash_attn adds one keyword of its own after them.
DIRECT = {
    opmesh.dense_lightning_indexer_softmax_lse: ("dense_lightning_indexer_softmax_lse", ()),
    opmesh.dense_lightning_indexer_grad_kl_loss: ("dense_lightning_indexer_grad_kl_loss", ()),
    opmesh.sparse_lightning_indexer_grad_kl_loss: ("sparse_lightning_indexer_grad_kl_loss", ()),
    opmesh.lightning_indexer: ("lightning_indexer", ()),
    opmesh.sparse_flash_attention: ("sparse_flash_attention", ()),
    opmesh.sparse_flash_mla: ("sparse_flash_mla", ()),
    opmesh.sparse_flash_mla_metadata: ("sparse_flash_mla_metadata", ()),
    opmesh.flash_attn: ("flash_attn", ("context_parallel",)),
    opmesh.flash_attn_metadata: ("flash_attn_metadata", ()),
    opmesh.merge_attn_states: ("merge_attn_states", ()),
    opmesh.kv_cache_write_: ("kv_cache_write_", ()),
    opmesh.compressor: ("compressor", ()),
}


def _parameters(function):
    return [
        (name, p.kind is inspect.Parameter.KEYWORD_ONLY)
        for name, p in inspect.signature(function).parameters.items()
    ]


def _schema_parameters(op):
    return [(a.name, a.kwarg_only) for a in _schema._SCHEMAS[op]]


@pytest.mark.parametrize("function", list(DIRECT), ids=lambda f: f.__name__)
def test_public_signature_is_the_schemas(function):
    op, extra = DIRECT[function]
    assert _parameters(function) == _schema_parameters(op) + [(n, True) for n in extra]
    for name, param in inspect.signature(function).parameters.items():
        has_default = param.default is not inspect.Parameter.empty
        declared = name in _schema.defaults(op)
        assert has_default == declared or name in extra, name


@pytest.mark.parametrize(
    "front, op, statistics",
    [
        (opmesh.indexer_kl_loss, "dense_lightning_indexer_grad_kl_loss", 2),
        (opmesh.sparse_indexer_kl_loss, "sparse_lightning_indexer_grad_kl_loss", 0),
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_loss_front_signature_is_its_operators_with_the_indexer_first(front, op, statistics):
    """A differentiable front takes its fused operator's parameters, the indexer's inputs
    first (what it differentiates), less the indexer statistics it computes itself."""
    from opmesh.distributed.ops.dsa import TABLES

    own = ("softmax_max_index", "softmax_sum_index")
    schema = [p for p in _schema_parameters(op) if p[0] not in own]
    assert len(_schema_parameters(op)) - len(schema) == statistics
    first = [p for p in schema if p[0] in ("query_index", "key_index", "weights")]
    rest = [p for p in schema if p not in first]
    assert _parameters(front) == first + rest
    assert tuple(n for n, _ in _parameters(front)) == TABLES[front.__name__].params
