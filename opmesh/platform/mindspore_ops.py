"""opmesh's operators on MindSpore tensors (CPU).

The public functions (``opmesh.flash_attn`` and the rest) come here when their tensors are
MindSpore tensors. Each call:

1. runs the argument checks of the torch binding's shape functions on meta stand-ins of its
   tensors (same shapes and dtypes, no data): one set of checks and messages for both frameworks;
2. reads its small host arrays (sequence lengths, block table, plan words, slots);
3. calls the MindSpore binding (``csrc/mindspore``), which runs the checks that read those
   values, queues the op on MindSpore's pipeline, and runs the core's kernel on the calling
   thread once MindSpore hands over the ready inputs (csrc/mindspore/runtime.cpp).

The binding is compiled by MindSpore's ``CustomOpBuilder`` on first use from the sources and the
core library the package installs with ``OPMESH_MINDSPORE=ON`` (docs/mindspore.md), into a cache
directory keyed by their contents and the MindSpore version.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import operator
import os

import torch

from .. import _C, _schema
from ..distributed.dfunction import DFunction
from . import is_mindspore_tensor as is_tensor
from . import scaled_gradients

CACHE_ENV = "OPMESH_MINDSPORE_CACHE"


def binding_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(_C.__file__)), "mindspore_binding")


@functools.cache
def extension():
    """The compiled MindSpore binding, built on first use (about a minute and a half on two
    cores) and cached."""
    import mindspore
    from mindspore.ops import CustomOpBuilder

    root = binding_dir()
    library = os.path.join(root, "libopmesh_core_ms.a")
    if not os.path.exists(library):
        raise ImportError(
            "opmesh was built without the MindSpore binding: reinstall it with "
            "`pip install --no-build-isolation -C cmake.define.OPMESH_MINDSPORE=ON .` "
            "(docs/mindspore.md)"
        )
    sources = sorted(glob.glob(os.path.join(root, "src", "*.cpp")))
    headers = sorted(glob.glob(os.path.join(root, "**", "*.h"), recursive=True))
    digest = hashlib.sha256(mindspore.__version__.encode())
    for path in [library, *sources, *headers]:
        with open(path, "rb") as f:
            digest.update(path.encode() + f.read())
    cache = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "opmesh")
    with open(os.path.join(root, "cflags.txt")) as f:
        defines = f.read().strip()
    builder = CustomOpBuilder(
        "opmesh_mindspore",
        sources,
        backend="CPU",
        include_paths=[os.path.join(root, "include"), os.path.join(root, "src")],
        cflags=f"-O2 -fopenmp-simd {defines}".strip(),
        ldflags=f"-Wl,--whole-archive {library} -Wl,--no-whole-archive",
        build_dir=os.path.join(cache, f"mindspore-{digest.hexdigest()[:16]}"),
    )
    return builder.load()


def _call(name: str, **kwargs):
    """Calls the binding with its operator's schema arguments by name (csrc/common/op_defs.h).
    Each of its functions returns once its kernel has run (see csrc/mindspore/runtime.cpp), so an
    error in a kernel raises at its call."""
    return getattr(extension(), name)(**kwargs)


# MindSpore dtype names -> the torch dtype of the meta stand-in the shared checks see.
_DTYPES = {
    "Float32": torch.float32,
    "Float16": torch.float16,
    "BFloat16": torch.bfloat16,
    "Float64": torch.float64,
    "Int32": torch.int32,
    "Int64": torch.int64,
    "Int16": torch.int16,
    "Int8": torch.int8,
    "UInt8": torch.uint8,
    "Bool": torch.bool,
    "Complex64": torch.complex64,
}


def _meta(value, name: str):
    """A meta tensor with value's shape and dtype, for the shared checks (None stays None)."""
    if value is None:
        return None
    if not is_tensor(value):
        raise TypeError(
            f"{name}: expected a MindSpore tensor like the call's other tensors, got "
            f"{type(value).__module__}.{type(value).__name__}"
        )
    dtype = _DTYPES.get(str(value.dtype))
    if dtype is None:
        raise TypeError(f"{name}: dtype {value.dtype} is not supported")
    return torch.empty(tuple(value.shape), dtype=dtype, device="meta")


def _ints(value, name: str) -> list[int]:
    out = []
    for i, item in enumerate(value):
        try:
            if isinstance(item, bool):
                raise TypeError
            out.append(operator.index(item))
        except TypeError:
            raise TypeError(
                f"{name}: entry {i} is {item!r} ({type(item).__name__}); lengths must be integers"
            ) from None
    return out


def _host(value, name: str, int32: bool = False):
    """(values as a flat list, meta stand-in) of a length-like argument: a MindSpore integer
    tensor or a list of ints; (None, None) when absent. With ``int32``, int64 values are taken
    as int32 after a range check, as the torch functions take them."""
    if value is None:
        return None, None
    if is_tensor(value):
        dtype = str(value.dtype)
        if dtype not in ("Int32", "Int64"):
            raise TypeError(f"{name}: expected int32 or int64, got {value.dtype}")
        values = [int(x) for x in value.asnumpy().reshape(-1)]
        shape = tuple(value.shape)
        meta_dtype = torch.int32 if int32 or dtype == "Int32" else torch.int64
    elif isinstance(value, (list, tuple)):
        values = _ints(value, name)
        shape = (len(values),)
        meta_dtype = torch.int32 if int32 else torch.int64
    else:
        raise TypeError(
            f"{name}: expected a 1-D int32/int64 MindSpore tensor, a list of ints or None, "
            f"got {type(value).__name__}"
        )
    if int32:
        for i, v in enumerate(values):
            if not -(2**31) <= v < 2**31:
                raise ValueError(f"{name}: entry {i} is {v}, outside the int32 range")
    return values, torch.empty(shape, dtype=meta_dtype, device="meta")


def _concrete(value):
    import mindspore

    return None if value is None else mindspore.Tensor(value)


def _empty_lse():
    import mindspore

    return mindspore.ops.zeros((0,), mindspore.float32)


def _indexer_mask(mask):
    """``mask``: the indexer's keyword arguments (lengths, layout, sparse_mode, band). Returns
    them for the shared checks (lengths as meta stand-ins) and as the binding takes them (lengths
    as host values)."""
    checks, host = dict(mask), dict(mask)
    for name in ("actual_seq_qlen", "actual_seq_klen", "cmp_residual_key"):
        host[name], checks[name] = _host(mask.get(name), name)
    return checks, host


def indexer(query_index, key_index, weights, mask):
    checks, host = _indexer_mask(mask)
    torch.ops.opmesh.dense_lightning_indexer_softmax_lse(
        _meta(query_index, "query_index"),
        _meta(key_index, "key_index"),
        _meta(weights, "weights"),
        **checks,
    )
    return tuple(
        _call("indexer", query_index=query_index, key_index=key_index, weights=weights, **host)
    )


def _table(value, name: str):
    """(rows of values, meta stand-in) of a 2-D integer argument: a MindSpore integer tensor or
    a list of lists of ints; (None, None) when absent."""
    if value is None or is_tensor(value):
        flat, meta = _host(value, name)
        if meta is None or meta.dim() != 2:
            return flat, meta
        cols = meta.shape[1]
        return [flat[i * cols : (i + 1) * cols] for i in range(meta.shape[0])], meta
    if isinstance(value, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in value):
        rows = [_ints(r, name) for r in value]
        cols = len(rows[0]) if rows else 0
        if any(len(r) != cols for r in rows):
            raise ValueError(f"{name}: rows of different lengths")
        return rows, torch.empty((len(rows), cols), dtype=torch.int64, device="meta")
    raise TypeError(
        f"{name}: expected a 2-D int32/int64 MindSpore tensor, a list of lists of ints or None, "
        f"got {type(value).__name__}"
    )


def lightning_indexer(call):
    """``call``: lightning_indexer's arguments by schema name. The shapes are checked by the
    torch shape function on meta stand-ins; the binding reads the lengths and table as host
    values."""
    host, metas = dict(call), dict(call)
    for name in ("actual_seq_lengths_query", "actual_seq_lengths_key", "cmp_residual_key"):
        host[name], metas[name] = _host(call[name], name)
    host["block_table"], metas["block_table"] = _table(call["block_table"], "block_table")
    tensors = [_meta(metas.pop(n), n) for n in _schema.positional("lightning_indexer")]
    torch.ops.opmesh.lightning_indexer(*tensors, **metas)
    return tuple(_call("lightning_indexer", **host))


_SPARSE_TENSORS = ("query", "key", "value", "query_rope", "key_rope", "sinks")
_SPARSE_HOST = ("actual_seq_lengths_query", "actual_seq_lengths_kv", "block_table")


def sparse_flash_attention(call):
    """``call``: sparse_flash_attention's arguments by schema name. The torch shape function
    checks the shapes on meta stand-ins; the binding runs forward and backward (differentiable
    through MindSpore's autograd, as on PyTorch)."""
    import mindspore

    if call.pop("key_scale", None) is not None or call.pop("value_scale", None) is not None:
        raise NotImplementedError(
            "key_scale: sparse_flash_attention reads a quantized key and value on PyTorch "
            "tensors only (on MindSpore, flash_attn takes int8 caches)"
        )
    host, metas = {}, {}
    for name in _SPARSE_HOST[:2]:
        host[name], metas[name] = _host(call[name], name)
    host["block_table"], metas["block_table"] = _table(call["block_table"], "block_table")
    tensors = {n: call[n] for n in _SPARSE_TENSORS}
    options = {
        n: x
        for n, x in call.items()
        if n not in _SPARSE_TENSORS and n not in _SPARSE_HOST and n != "sparse_indices"
    }
    indices = call["sparse_indices"]
    torch.ops.opmesh.sparse_flash_attention(
        _meta(tensors["query"], "query"),
        _meta(tensors["key"], "key"),
        _meta(tensors["value"], "value"),
        _meta(indices, "sparse_indices"),
        **{n: _meta(tensors[n], n) for n in _SPARSE_TENSORS[3:]},
        **metas,
        **options,
    )
    indices = _int32_indices(indices)
    if tensors["sinks"] is not None:
        tensors["sinks"] = tensors["sinks"].astype(mindspore.float32)
    return _sparse_function().apply(*(tensors[n] for n in _SPARSE_TENSORS), indices, host, options)


def _int32_indices(indices, name="sparse_indices"):
    """Indices as int32 for the binding; int64 entries outside [-1, 2**31) are refused
    (narrowing could turn a bad entry into a valid one), as the torch operators refuse them."""
    import mindspore

    if str(indices.dtype) == "Int64" and indices.size > 0:
        values = indices.asnumpy()
        lo, hi = int(values.min()), int(values.max())
        if lo < -1 or hi >= 2**31:
            raise ValueError(
                f"{name}: entries must be -1 or key positions, got values in [{lo}, {hi}]"
            )
    return indices.astype(mindspore.int32)


@functools.cache
def _sparse_function():
    class SparseFlashAttentionFunction(DFunction):
        """sparse_flash_attention on MindSpore tensors: the binding's forward and backward."""

        @staticmethod
        def forward(ctx, query, key, value, query_rope, key_rope, sinks, indices, host, options):
            out, smax, ssum = _call(
                "sparse_flash_attention",
                query=query, key=key, value=value, sparse_indices=indices, query_rope=query_rope,
                key_rope=key_rope, sinks=sinks, **host,
                **dict(options, return_softmax_lse=True),
            )  # fmt: skip
            ctx.save_for_backward(query, key, value, query_rope, key_rope, sinks, indices, out,
                                  smax, ssum)  # fmt: skip
            ctx.call = (host, options)
            if options["return_softmax_lse"]:
                return out, smax, ssum
            return out, _empty_lse(), _empty_lse()

        @staticmethod
        def backward(ctx, dout, _dmax, _dsum):
            saved = [_concrete(x) for x in ctx.saved_tensors]
            query, key, value, query_rope, key_rope, sinks, indices, out, smax, ssum = saved
            host, options = ctx.call
            options = {n: x for n, x in options.items() if n != "return_softmax_lse"}
            grads = _call(
                "sparse_flash_attention_backward",
                dout=_concrete(dout), query=query, key=key, value=value,
                sparse_indices=indices, attention_out=out, softmax_max=smax, softmax_sum=ssum,
                query_rope=query_rope, key_rope=key_rope, sinks=sinks, **host, **options,
            )  # fmt: skip
            dq, dk, dv, dqr, dkr, dsinks = grads
            rope = query_rope is not None
            return (
                dq, dk, dv, dqr if rope else None, dkr if rope else None,
                dsinks if sinks is not None else None, None, None, None,
            )  # fmt: skip

    return SparseFlashAttentionFunction


_MLA_TENSORS = ("q", "ori_kv", "cmp_kv", "sinks")
_MLA_INDICES = ("ori_sparse_indices", "cmp_sparse_indices", "ori_topk_length", "cmp_topk_length")
_MLA_HOST = (
    "cu_seqlens_q", "cu_seqlens_ori_kv", "cu_seqlens_cmp_kv", "seqused_q", "seqused_ori_kv",
    "seqused_cmp_kv", "cmp_residual_kv", "metadata",
)  # fmt: skip
_MLA_TABLES = ("ori_block_table", "cmp_block_table")


def sparse_flash_mla(call):
    """``call``: sparse_flash_mla's arguments by schema name. The torch shape function checks the
    shapes on meta stand-ins; the binding runs forward and backward (differentiable through
    MindSpore's autograd, as on PyTorch)."""
    import mindspore

    for name in ("ori_kv_scale", "cmp_kv_scale"):
        if call.pop(name, None) is not None:
            raise NotImplementedError(
                f"{name}: sparse_flash_mla reads a quantized kv on PyTorch tensors only (on "
                "MindSpore, flash_attn takes int8 caches)"
            )
    host, metas = {}, {}
    for name in _MLA_HOST:
        host[name], metas[name] = _host(call[name], name)
    for name in _MLA_TABLES:
        host[name], metas[name] = _table(call[name], name)
    tensors = {n: call[n] for n in _MLA_TENSORS}
    indices = {n: call[n] for n in _MLA_INDICES}
    options = {
        n: x
        for n, x in call.items()
        if n not in _MLA_TENSORS + _MLA_INDICES + _MLA_HOST + _MLA_TABLES
    }
    torch.ops.opmesh.sparse_flash_mla(
        _meta(tensors["q"], "q"),
        **{n: _meta(tensors[n], n) for n in _MLA_TENSORS[1:]},
        **{n: _meta(indices[n], n) for n in _MLA_INDICES},
        **metas,
        **options,
    )
    indices = {n: None if t is None else _int32_indices(t, n) for n, t in indices.items()}
    if tensors["sinks"] is not None:
        tensors["sinks"] = tensors["sinks"].astype(mindspore.float32)
    return _mla_function().apply(*(tensors[n] for n in _MLA_TENSORS), indices, {**host, **options})


@functools.cache
def _mla_function():
    class SparseFlashMlaFunction(DFunction):
        """sparse_flash_mla on MindSpore tensors: the binding's forward and backward."""

        @staticmethod
        def forward(ctx, q, ori_kv, cmp_kv, sinks, indices, options):
            out, lse = _call(
                "sparse_flash_mla", q=q, ori_kv=ori_kv, cmp_kv=cmp_kv, sinks=sinks, **indices,
                **dict(options, return_softmax_lse=True),
            )  # fmt: skip
            ctx.save_for_backward(q, ori_kv, cmp_kv, sinks, out, lse)
            ctx.call = (indices, options)
            if options["return_softmax_lse"]:
                return out, lse
            return out, mindspore_zero()

        @staticmethod
        def backward(ctx, dout, dlse):
            q, ori_kv, cmp_kv, sinks, out, lse = (_concrete(x) for x in ctx.saved_tensors)
            indices, options = ctx.call
            dlse = _concrete(dlse) if options["return_softmax_lse"] else None
            drop = ("return_softmax_lse", "metadata")
            options = {n: x for n, x in options.items() if n not in drop}
            dq, d_ori, d_cmp, dsinks = _call(
                "sparse_flash_mla_backward", dout=_concrete(dout), q=q, attention_out=out,
                softmax_lse=lse, dlse=dlse, ori_kv=ori_kv, cmp_kv=cmp_kv, sinks=sinks, **indices,
                **options,
            )  # fmt: skip
            return (
                dq, d_ori if ori_kv is not None else None, d_cmp if cmp_kv is not None else None,
                dsinks if sinks is not None else None, None, None,
            )  # fmt: skip

    return SparseFlashMlaFunction


_COMPRESSOR_HOST = ("cu_seqlens", "seqused", "start_pos")


def compressor(call):
    """``call``: compressor's arguments by schema name. The torch shape function checks the
    shapes on meta stand-ins; the binding writes the state cache in place and computes cmp_kv,
    differentiable in x, wkv, wgate and ape through MindSpore's autograd, as on PyTorch."""
    import mindspore

    host, metas = {}, {}
    for name in _COMPRESSOR_HOST:
        host[name], metas[name] = _host(call[name], name)
    table = call["state_block_table"]
    if call["cache_mode"] == 2 and isinstance(table, (list, tuple)):
        rows, table_meta = _host(table, "state_block_table")  # a ring's [B] list
    else:
        rows, table_meta = _table(table, "state_block_table")
    if table_meta is not None and table_meta.dim() == 1:
        rows = [[v] for v in rows]  # a ring's [B] table: one block per row
    state = call["state_cache"]
    if state is None:
        state = mindspore.ops.zeros((0, 1, 2 * call["wkv"].shape[0]), mindspore.float32)
    projections = call["projections"]
    for name, t in (("state_cache", state), ("projections", projections)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous on MindSpore (it is written in place)")
    options = {n: call[n] for n in ("cmp_ratio", "coff", "cache_mode")}
    tensors = {n: call[n] for n in ("x", "wkv", "wgate", "ape")}
    torch.ops.opmesh.compressor(
        _meta(tensors["x"], "x"), _meta(tensors["wkv"], "wkv"), _meta(tensors["wgate"], "wgate"),
        _meta(state, "state_cache"), _meta(tensors["ape"], "ape"),
        state_block_table=table_meta, **metas, **options,
        projections=None if projections is None else _meta(projections, "projections"),
    )  # fmt: skip
    fixed = dict(host, state_block_table=rows, state_cache=state, projections=projections,
                 **options)  # fmt: skip
    return _compressor_function().apply(*tensors.values(), fixed)


def _first(result):
    return result[0] if isinstance(result, (tuple, list)) else result


@functools.cache
def _compressor_function():
    class CompressorFunction(DFunction):
        """compressor on MindSpore tensors: the binding's forward and backward."""

        @staticmethod
        def forward(ctx, x, wkv, wgate, ape, fixed):
            import mindspore

            # With a gradient to come, every token's projections are kept for the backward,
            # which then runs two products instead of three.
            if fixed["projections"] is None and any(ctx.needs_input_grad[:4]):
                shape = (*x.shape[:-1], 2 * wkv.shape[0])
                fixed = dict(fixed, projections=mindspore.ops.zeros(shape, mindspore.float32))
            ctx.save_for_backward(x, wkv, wgate, ape)
            ctx.fixed = fixed
            return _first(_call("compressor", x=x, wkv=wkv, wgate=wgate, ape=ape, **fixed))

        @staticmethod
        def backward(ctx, grad):
            x, wkv, wgate, ape = (_concrete(t) for t in ctx.saved_tensors)
            fixed = {
                n: v
                for n, v in ctx.fixed.items()
                if n not in ("state_cache", "state_block_table", "cache_mode")
            }
            dx, dwkv, dwgate, dape = _call(
                "compressor_backward", grad_cmp_kv=_concrete(grad), x=x, wkv=wkv, wgate=wgate,
                ape=ape, **fixed,
            )  # fmt: skip
            return dx, dwkv, dwgate, dape, None

    return CompressorFunction


def from_torch(tensor):
    """A host-side torch result (a plan) as a MindSpore tensor."""
    import mindspore

    return mindspore.Tensor(tensor.numpy())


def mindspore_zero():
    """The float32 scalar 0 sparse_flash_mla returns without return_softmax_lse."""
    import mindspore

    return mindspore.ops.zeros((), mindspore.float32)


# The fused KL op's tensors (its positional parameters but the scale).
_KL_TENSORS = _schema.positional("dense_lightning_indexer_grad_kl_loss")[:-1]


def grad_kl_loss(args, query_rope, key_rope, mask, differentiable=True):
    """``args``: dense_lightning_indexer_grad_kl_loss's nine tensors and scale_value, in its
    order; ``mask`` as for the indexer. With ``differentiable``, the loss is differentiable in
    query_index, key_index and weights through MindSpore's autograd, as on PyTorch (the main
    attention and the statistics are a fixed target, like ``ops.stop_gradient`` inputs)."""
    *tensors, scale_value = args
    checks, host = _indexer_mask(mask)
    torch.ops.opmesh.dense_lightning_indexer_grad_kl_loss(
        *(_meta(t, name) for t, name in zip(tensors, _KL_TENSORS, strict=True)),
        scale_value,
        query_rope=_meta(query_rope, "query_rope"),
        key_rope=_meta(key_rope, "key_rope"),
        **checks,
    )
    call = dict(
        zip(_KL_TENSORS, tensors, strict=True),
        scale_value=float(scale_value),
        query_rope=query_rope,
        key_rope=key_rope,
        **host,
    )
    if differentiable:
        return _kl_function().apply(
            call["query_index"], call["key_index"], call["weights"], call, _DENSE_KL_KERNEL
        )
    return _kl_call(call, _DENSE_KL_KERNEL)


_SPARSE_KL = "sparse_lightning_indexer_grad_kl_loss"
_SPARSE_KL_TENSORS = _schema.positional(_SPARSE_KL)[:-1]
# The indexer family's mask and length arguments.
_MASK = (
    "actual_seq_qlen", "actual_seq_klen", "layout", "sparse_mode", "pre_tokens", "next_tokens",
    "cmp_ratio", "cmp_residual_key",
)  # fmt: skip
# The binding's kernels of the two KL losses.
_DENSE_KL_KERNEL = "indexer_grad_kl_loss"
_SPARSE_KL_KERNEL = "sparse_indexer_grad_kl_loss"


def sparse_grad_kl_loss(call, differentiable=True):
    """``call``: sparse_lightning_indexer_grad_kl_loss's arguments by schema name (extra names
    are ignored). Shapes are checked by the torch shape function on meta stand-ins; with
    ``differentiable`` the loss is differentiable in query_index, key_index and weights through
    MindSpore's autograd, as on PyTorch."""
    mask = {n: call[n] for n in _MASK}
    checks, host = _indexer_mask(mask)
    tensors = {n: call[n] for n in _SPARSE_KL_TENSORS}
    ropes = {n: call[n] for n in ("query_rope", "key_rope")}
    torch.ops.opmesh.sparse_lightning_indexer_grad_kl_loss(
        *(_meta(t, n) for n, t in tensors.items()),
        call["scale_value"],
        **{n: _meta(t, n) for n, t in ropes.items()},
        **checks,
    )
    tensors["sparse_indices"] = _int32_indices(tensors["sparse_indices"])
    args = dict(tensors, scale_value=float(call["scale_value"]), **ropes, **host)
    if differentiable:
        return _kl_function().apply(
            args["query_index"], args["key_index"], args["weights"], args, _SPARSE_KL_KERNEL
        )
    return _kl_call(args, _SPARSE_KL_KERNEL)


def _kl_call(call, kernel):
    return tuple(_call(kernel, **call))


@functools.cache
def _kl_function():
    """The fused KL ops' autograd on MindSpore (either kernel), made on first use."""

    class GradKlLossFunction(DFunction):
        """The loss's backward scales the gradients the op returned; those gradients have none
        (no second order). The fixed target travels in ``call``, outside autograd."""

        @staticmethod
        def forward(ctx, query_index, key_index, weights, call, kernel):
            d_query_index, d_key_index, d_weights, loss = _kl_call(call, kernel)
            ctx.save_for_backward(d_query_index, d_key_index, d_weights)
            ctx.mark_non_differentiable(d_query_index, d_key_index, d_weights)
            return d_query_index, d_key_index, d_weights, loss

        @staticmethod
        def backward(ctx, _dqi, _dki, _dw, grad_loss):
            return (*scaled_gradients(ctx.saved_tensors, grad_loss), None, None)

    return GradKlLossFunction


def kv_cache_write_(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale):
    if value is None or value_cache is None:
        raise NotImplementedError(
            "value: and value_cache are required on MindSpore tensors (one cache of rows read as "
            "key and value, without them, is written on PyTorch tensors)"
        )
    slots, slots_meta = _host(slot_mapping, "slot_mapping")
    if slots is None:
        raise TypeError("slot_mapping: expected a 1-D int32/int64 tensor or a list of ints")
    scales = {"key_scale": key_scale, "value_scale": value_scale}
    torch.ops.opmesh.kv_cache_write_(
        _meta(key, "key"),
        _meta(value, "value"),
        _meta(key_cache, "key_cache"),
        _meta(value_cache, "value_cache"),
        slots_meta,
        **{n: None if t is None else _meta(t, n) for n, t in scales.items()},
    )
    written = [(key_cache, "key_cache"), (value_cache, "value_cache")]
    written += [(t, n) for n, t in scales.items() if t is not None]
    for cache, name in written:
        if not cache.is_contiguous():
            raise ValueError(f"{name}: must be contiguous on MindSpore (it is written in place)")
    if key_cache is value_cache:
        raise ValueError("value_cache: must not be key_cache")
    _call(
        "kv_cache_write",
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slots,
        **{n: t for n, t in scales.items() if t is not None},
    )


_LENGTHS = _schema.ATTN_LENGTHS


def flash_attn_metadata(num_heads_q, num_heads_kv, head_dim, kwargs):
    """``kwargs``: flash_attn_metadata's keyword arguments with the layouts resolved."""
    import mindspore
    import numpy as np  # (MindSpore's path only: the operators on torch tensors need no numpy)

    batch_size = kwargs["batch_size"]
    counts = dict(cu_seqlens_q=batch_size + 1, cu_seqlens_kv=batch_size + 1)
    host = {}
    for name in _LENGTHS:
        values, meta = _host(kwargs[name], name, int32=True)
        if values is not None:
            if meta.dim() != 1:
                raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(meta.shape)}")
            count = counts.get(name, batch_size)
            if len(values) != count:
                raise ValueError(f"{name}: expected {count} entries, got {len(values)}")
        host[name] = values
    words = _call(
        "flash_attn_metadata",
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        head_dim=head_dim,
        **dict(kwargs, **host),
    )
    return mindspore.Tensor(np.asarray(words, dtype=np.int32))


def _plan_words(metadata):
    """A plan's words and meta stand-in: a MindSpore tensor, or a torch tensor (a plan made by
    the torch function is the same words)."""
    if metadata is None:
        return None, None
    if isinstance(metadata, torch.Tensor):
        if metadata.dtype != torch.int32 or metadata.dim() != 1:
            raise TypeError("metadata: expected the 1-D int32 tensor flash_attn_metadata returns")
        return metadata.tolist(), torch.empty(metadata.shape, dtype=torch.int32, device="meta")
    return _host(metadata, "metadata")


def _flash_host(kwargs):
    """The host arrays of a flash_attn call (the block table as rows) and their meta
    stand-ins."""
    host, metas = {}, {}
    for name in _LENGTHS:
        host[name], metas[name] = _host(kwargs[name], name, int32=True)
    table, metas["block_table"] = _host(kwargs["block_table"], "block_table", int32=True)
    if table is not None and metas["block_table"].dim() == 2:
        cols = metas["block_table"].shape[1]
        table = [table[i * cols : (i + 1) * cols] for i in range(metas["block_table"].shape[0])]
    host["block_table"] = table
    host["metadata"], metas["metadata"] = _plan_words(kwargs["metadata"])
    return host, metas


def flash_attn(q, k, v, kwargs):
    """``kwargs``: flash_attn's keyword arguments with the layouts resolved."""
    if getattr(kwargs["alibi_slopes"], "requires_grad", False):
        # A Parameter that asks for a gradient (plain MindSpore tensors carry no such flag).
        raise ValueError(
            "alibi_slopes: flash_attn has no gradient for the ALiBi slopes (fixed per head); "
            "pass a tensor, or a Parameter with requires_grad=False"
        )
    host, metas = _flash_host(kwargs)
    tensors = ("sinks", "alibi_slopes", "k_scale", "v_scale")
    options = {n: x for n, x in kwargs.items() if n not in host and n not in tensors}
    torch.ops.opmesh.flash_attn(
        _meta(q, "q"),
        _meta(k, "k"),
        _meta(v, "v"),
        **{n: _meta(kwargs[n], n) for n in tensors},
        **metas,
        **options,
    )
    # A quantized cache's scales travel with the host arrays: read by the forward, refused by
    # the backward.
    host.update({n: kwargs[n] for n in ("k_scale", "v_scale") if kwargs[n] is not None})
    return _flash_function().apply(q, k, v, kwargs["sinks"], kwargs["alibi_slopes"], host, options)


_BACKWARD = _schema.positional("flash_attn_backward")


def _int32_meta(values):
    return None if values is None else torch.empty(len(values), dtype=torch.int32, device="meta")


@functools.cache
def _flash_function():
    """The DFunction below, made on first use (opmesh.distributed imports opmesh's ops)."""

    class FlashAttnFunction(DFunction):
        """flash_attn on MindSpore tensors: the binding's forward and backward, as a DFunction
        (on MindSpore it runs as MindSpore's autograd Function)."""

        @staticmethod
        def forward(ctx, q, k, v, sinks, alibi_slopes, host, options):
            # The lse is computed whether asked or not: the backward needs it.
            out, lse = _call(
                "flash_attn",
                q=q,
                k=k,
                v=v,
                sinks=sinks,
                alibi_slopes=alibi_slopes,
                **host,
                **dict(options, return_softmax_lse=True),
            )
            ctx.save_for_backward(q, k, v, out, lse, sinks, alibi_slopes)
            ctx.call = (host, options)
            return out, (lse if options["return_softmax_lse"] else _empty_lse())

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse, sinks, alibi_slopes = ctx.saved_tensors
            host, options = ctx.call
            if "k_scale" in host:
                raise ValueError(
                    "k_scale: flash_attn has no backward through a quantized (int8) cache; decode "
                    "from it without gradients, or train on a float cache"
                )
            lengths = {n: host[n] for n in _LENGTHS}
            options = {n: x for n, x in options.items() if n != "return_softmax_lse"}
            dlse = dlse if ctx.call[1]["return_softmax_lse"] else None
            # The backward's checks are the torch binding's too (e.g. paged keys have none).
            torch.ops.opmesh.flash_attn_backward(
                *(_meta(x, n) for x, n in zip((dout, q, k, v, out, lse), _BACKWARD, strict=True)),
                dlse=_meta(dlse, "dlse"),
                sinks=_meta(sinks, "sinks"),
                alibi_slopes=_meta(alibi_slopes, "alibi_slopes"),
                **{n: _int32_meta(x) for n, x in lengths.items()},
                **options,
            )
            # Inside MindSpore's backward, a pending result (a stub) handed to an extension
            # cannot be resolved there; a Tensor made from it can.
            dout, q, k, v, out, lse, dlse, sinks, alibi_slopes = (
                _concrete(x) for x in (dout, q, k, v, out, lse, dlse, sinks, alibi_slopes)
            )
            dq, dk, dv, dsinks = _call(
                "flash_attn_backward",
                **dict(zip(_BACKWARD, (dout, q, k, v, out, lse), strict=True)),
                dlse=dlse,
                sinks=sinks,
                alibi_slopes=alibi_slopes,
                **lengths,
                **options,
            )
            # The ALiBi slopes get no gradient (as on torch).
            return dq, dk, dv, (dsinks if sinks is not None else None), None, None, None

    return FlashAttnFunction
