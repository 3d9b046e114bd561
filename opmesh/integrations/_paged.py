"""``"paged|opmesh"``: transformers' continuous batching on opmesh's paged attention.

transformers' continuous batching (``generate_batch``, ``ContinuousBatchingManager`` and
``transformers serve --continuous-batching``) packs every scheduled request's new tokens into one
sequence of ``T`` tokens and keeps all keys and values in its own paged cache. Its attention
function gets ``query [1, H, T, D]``, this step's ``key``/``value [1, Hkv, T, D]``, the cache, the
cumulative query and key lengths, and per cache group the slots to write (``write_index``) and to
read (``read_index``).

On full-attention layers the new keys and values go into transformers' cache with
:func:`opmesh.kv_cache_write_` and :func:`opmesh.flash_attn` reads the cache in place through a
block table taken from the read slots: no copy of the cache per step. Sliding-window layers keep
transformers' ring of the last ``window - 1`` keys, read by its own ``cache.update`` (at most a
window per request), and attend with the window mask. Sinks (``s_aux``), softcap and the module's
scaling are honoured; a call this function cannot run exactly is refused by the argument's name.

``register(kv_cache="int8")`` (or ``"fp8"``) stores the full-attention layers' keys and values
quantized: each row of transformers' cache holds the row's bytes and its float32 scale in its
own first ``D + 4`` bytes (``kv_cache_write_`` and ``flash_attn`` with ``k_scale``/``v_scale``),
so a decode step reads about half the bytes, and transformers' block copies and sharing carry
the scales with the rows. See docs/transformers.md.
"""

from __future__ import annotations

import torch

from .. import ops

PAGED_NAME = "paged|opmesh"

# The cache format of full-attention layers: None (the cache's dtype), or a quantized dtype.
KV_CACHE_FORMATS = {None: None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
_settings = {"kv_cache": None}


def set_kv_cache(kv_cache: str | None) -> None:
    """Sets the format paged|opmesh stores full-attention layers' keys and values in (before a
    generation starts: a cache is read in the format it was written in)."""
    if kv_cache not in KV_CACHE_FORMATS:
        raise ValueError(f"kv_cache: expected None, 'int8' or 'fp8', got {kv_cache!r}")
    _settings["kv_cache"] = kv_cache


@torch.compiler.disable  # the cache is written in place, as transformers' own paged functions do
def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    cache=None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | dict[str, torch.Tensor] | None = None,
    read_index: list[torch.Tensor] | None = None,
    write_index: list[torch.Tensor] | None = None,
    block_table: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function of ``"paged|opmesh"``: ``query [1, H, T, D]`` and this step's
    ``key``/``value [1, Hkv, T, D/Dv]`` in, ``[T, H, Dv]`` out (no attention weights)."""
    if cache is None:
        raise ValueError(
            "cache: paged|opmesh runs inside transformers' continuous batching, which passes its "
            "paged cache; for a standard forward use attn_implementation='opmesh'"
        )
    if block_table is not None:
        raise ValueError(
            "block_table: paged|opmesh reads and writes the cache through read_index and "
            "write_index; set the continuous batching config's max_blocks_per_request to 0"
        )
    if read_index is None or write_index is None or cu_seq_lens_q is None or cu_seq_lens_k is None:
        raise ValueError(
            "read_index: paged|opmesh needs continuous batching's read_index, write_index, "
            "cu_seq_lens_q and cu_seq_lens_k"
        )
    if attention_mask is not None:
        raise ValueError(
            "attention_mask: paged|opmesh builds its causal and window masks from the sequence "
            "lengths and takes no mask tensor"
        )
    if kwargs.get("indices") is not None:
        raise ValueError("indices: paged|opmesh has no top-k sparse attention (DSA) path")
    if dropout and module.training:
        raise ValueError(
            f"dropout: opmesh attention has no dropout, got p={dropout} in training; set the "
            "config's attention_dropout to 0"
        )
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError("is_causal: paged|opmesh serves causal decoders only")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"query: expected [1, H, T, D] packed tokens, got {tuple(query.shape)}")

    layer = module.layer_idx
    allocator = cache.layer_to_allocator[layer]
    if isinstance(cu_seq_lens_k, dict):
        layer_type = next(n for n, a in cache.cache_allocators.items() if a is allocator)
        cu_seq_lens_k = cu_seq_lens_k[layer_type]
    window = getattr(module, "sliding_window", None) if sliding_window is None else sliding_window
    ring = getattr(allocator, "sliding_window", None)
    if ring is not None and (window is None or window > ring):
        raise ValueError(
            f"sliding_window: this layer's cache keeps the last {ring} keys, but the layer "
            f"attends over a window of {window}"
        )
    mode, left, right = (3, -1, -1) if window is None else (4, window - 1, 0)
    common = dict(
        cu_seqlens_q=cu_seq_lens_q, layout_q="TND", softmax_scale=scaling,
        sinks=None if s_aux is None else s_aux.float(), softcap=softcap or None,
        mask_mode=mode, win_left=left, win_right=right,
    )  # fmt: skip
    q = query[0].transpose(0, 1)  # [T, H, D]
    group = allocator.index
    if not _in_place(allocator):
        # The cache keeps a ring per request (sliding windows): transformers writes it and
        # gathers each request's keys in order, at most a window of them.
        k, v = cache.update(key, value, layer, read_index, write_index)
        out, _ = ops.flash_attn(q, k, v, cu_seqlens_kv=cu_seq_lens_k, **common)
        return out, None

    k_cache, v_cache, tokens, block_tokens = _layer_cache(cache, allocator, layer)
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    written = write_index[group]
    slots = torch.div(written, block_tokens, rounding_mode="floor") * tokens + written % tokens
    scales = {}
    fmt = KV_CACHE_FORMATS[_settings["kv_cache"]]
    if fmt is not None:
        (k_cache, k_scale), (v_cache, v_scale) = (_quantized(c, fmt) for c in (k_cache, v_cache))
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        ops.kv_cache_write_(
            new_k, new_v, k_cache, v_cache, slots, key_scale=k_scale, value_scale=v_scale
        )
    else:
        ops.kv_cache_write_(new_k, new_v, k_cache, v_cache, slots)
    read = read_index[group]
    if read.numel() == 0 and not scales:
        # No request has earlier keys: each attends over this step's own.
        out, _ = ops.flash_attn(q, new_k, new_v, cu_seqlens_kv=cu_seq_lens_k, **common)
        return out, None
    if read.numel() == 0:
        # A quantized cache: this step's keys as the cache holds them, where they were written.
        read = written
    # Key j of request r was read from slot read[cu_k[r] + j]; each block's first slot names it.
    cu_k = cu_seq_lens_k.long()
    lengths = cu_k[1:] - cu_k[:-1]
    blocks = torch.div(lengths + tokens - 1, tokens, rounding_mode="floor")
    step = torch.arange(int(blocks.max()), device=read.device)
    first = (cu_k[:-1, None] + step * tokens).clamp(max=read.numel() - 1)
    table = torch.where(
        step < blocks[:, None], torch.div(read[first], block_tokens, rounding_mode="floor"), 0
    )
    out, _ = ops.flash_attn(
        q, k_cache, v_cache, block_table=table.int(), seqused_kv=lengths.int(), **scales, **common
    )
    return out, None


def _quantized(pages: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized cache in the memory of transformers' ``[blocks, tokens, Hkv, D]`` view: each
    row's first D bytes hold its elements in ``fmt`` and the next 4 its float32 scale."""
    d = pages.shape[-1]
    if pages.element_size() * d < d + 4 or d % 4:
        raise ValueError(
            f"kv_cache: a quantized row and its scale need D + 4 bytes of each cache row, D a "
            f"multiple of 4; this layer's rows have D = {d} of {pages.dtype}"
        )
    raw = pages.view(torch.int8)  # [blocks, tokens, Hkv, e * D] bytes
    return raw[..., :d].view(fmt), raw[..., d : d + 4].view(torch.float32)[..., 0]


def _in_place(allocator) -> bool:
    """Whether the group keeps each request's keys in whole blocks, key ``j`` at slot ``j`` of
    its block (transformers' full-attention groups), which flash_attn reads through a table."""
    return bool(getattr(allocator, "supports_block_table", False)) and hasattr(
        allocator, "block_physical_stride"
    )


def _layer_cache(cache, allocator, layer: int):
    """This layer's keys and values in transformers' cache as ``[blocks, tokens, Hkv, D]`` views
    (one block of every cache block, a block's pages of other layers in between), the tokens of a
    block, and the slots between two blocks' first tokens."""
    _, k_pages, v_pages = cache.get_cache_for_block_table(layer)
    tokens = allocator.tokens_per_page
    block_tokens = allocator.block_physical_stride
    pages = block_tokens // tokens
    return k_pages[::pages], v_pages[::pages], tokens, block_tokens
