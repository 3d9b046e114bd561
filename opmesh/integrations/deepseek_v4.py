"""transformers' DeepSeek-V4 (``deepseek_v4``) attention on opmesh's V4 operators.

:func:`opmesh.integrations.transformers.register` installs :func:`attention_forward` as the
forward of ``DeepseekV4Attention`` for modules whose model runs ``attn_implementation="opmesh"``
(every other implementation keeps the model's own forward). A layer then runs:

* its compressors (the CSA layer's and its indexer's two overlapping series, the HCA layer's one)
  on :func:`opmesh.compressor`, followed by the model's own normalisation and rotary embedding of
  the entries; with a cache the compressor's state (the projections of the tokens of windows not
  yet closed) lives beside transformers' cache layer, and the entries join the layer's list of
  compressed entries, so transformers' cache stays what its eager path keeps;
* its indexer on :func:`opmesh.lightning_indexer` over the compressed keys (``cmp_ratio``);
* its attention on :func:`opmesh.sparse_flash_mla`: the sliding window of the raw keys, the
  compressed entries each row may see (HCA) or the indexer picked (CSA), and the sinks, in one
  softmax. No dense ``[B, 1, S, window + compressed]`` bias is built.

Compressor windows follow token slots and the visibility of compressed entries follows
``position_ids``, as in the model's eager path; padding (on either side) is read from the mask
into packed sequences. A mask that is not the sliding-window pattern over padded rows, packed
sequences, positions that do not step by one within a row, or a cache this path did not fill are
refused by name.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from .. import ops
from ._masks import _plan, _visible

STATE = "_opmesh_compressor_state"  # {name: float32 ring [B + 1, block, 2W]} on a cache layer
KEYS = "_opmesh_keys"  # the layer's keys as opmesh last left them


def attention_forward(
    self, hidden_states, position_embeddings, position_ids, attention_mask,
    past_key_values=None, **kwargs,
):  # fmt: skip
    """``DeepseekV4Attention.forward`` on opmesh (same arguments and outputs)."""
    if self.training and self.attention_dropout:
        raise ValueError(
            f"dropout: opmesh attention has no dropout, got p={self.attention_dropout} in "
            "training; set the config's attention_dropout to 0"
        )
    batch, length = hidden_states.shape[:2]
    q, kv, q_residual = project(self, hidden_states, position_embeddings)
    layer, start = _cache_layer(self, past_key_values, length)
    kv = kv.transpose(1, 2)
    if past_key_values is not None:  # the window's cached keys, then the new ones
        kv = past_key_values.update(kv, kv, self.layer_idx)[0]
        if layer is not None:
            layer.__dict__[KEYS] = layer.keys  # what a later call checks the cache against
    rows = _Rows.read(attention_mask, position_ids, batch, length, self)
    call = dict(
        ori_mask_mode=4, ori_win_left=self.sliding_window - 1, ori_win_right=0,
        softmax_scale=self.scaling, sinks=self.sinks,
    )  # fmt: skip
    if self.compressor is not None:
        call |= _compressed_keys(self, hidden_states, q_residual, position_ids, layer, start, rows)
    out = rows.attend(q, kv.transpose(1, 2), call)  # [B, S, H, D]
    return output(self, out, position_embeddings), None


def project(module, hidden_states, position_embeddings):
    """A ``DeepseekV4Attention``'s queries ``[B, S, H, D]``, shared key/value rows
    ``[B, S, 1, D]`` (both with their rotary embedding) and the query's low-rank residual, as
    the model computes them."""
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    batch, length = hidden_states.shape[:2]
    cos, sin = position_embeddings[module.rope_layer_type]
    q_residual = module.q_a_norm(module.q_a_proj(hidden_states))
    q = module.q_b_proj(q_residual).view(batch, length, -1, module.head_dim).transpose(1, 2)
    q = rotate(module.q_b_norm(q), cos, sin)
    kv = module.kv_norm(module.kv_proj(hidden_states)).view(batch, length, 1, -1).transpose(1, 2)
    kv = rotate(kv, cos, sin)
    return q.transpose(1, 2), kv.transpose(1, 2), q_residual


def output(module, out, position_embeddings):
    """The attention's output ``[B, S, H, D]`` through the model's output projection (the
    value's rotary embedding undone at the query's position first, as the model does)."""
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    cos, sin = position_embeddings[module.rope_layer_type]
    batch, length = out.shape[:2]
    out = rotate(out.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = module.o_a_proj(out.reshape(batch, length, module.config.o_groups, -1))
    return module.o_b_proj(grouped.flatten(2))


def index_queries(indexer, hidden_states, q_residual, position_ids):
    """A CSA indexer's queries ``[B, S, Hi, Di]`` (rotary at ``position_ids``) and its weights
    ``[B, S, Hi]`` float32 with the score's scales folded in (``relu(c x) = c relu(x)`` for
    ``c > 0``)."""
    rotate = sys.modules[type(indexer).__module__].apply_rotary_pos_emb
    batch, length = hidden_states.shape[:2]
    cos, sin = indexer.rotary_emb(hidden_states, position_ids=position_ids,
                                  layer_type=indexer.rope_layer_type)  # fmt: skip
    q = indexer.q_b_proj(q_residual).view(batch, length, -1, indexer.head_dim)
    q = rotate(q.transpose(1, 2), cos, sin).transpose(1, 2)
    scorer = indexer.scorer
    weights = scorer.weights_proj(hidden_states).float()
    return q, weights * (scorer.weights_scaling * scorer.softmax_scale)


def compress(compressor, hidden_states, start=0, state=None, **cache):
    """The entries a compressor module makes from ``hidden_states`` (the tokens at slots
    ``start, start + 1, ...``): :func:`opmesh.compressor` (``coff=2`` for a CSA series), then the
    module's normalisation and rotary embedding at each entry's first slot. Returns the new
    entries ``[B, n, D]``. ``state`` and ``cache`` (``state_block_table``, ``cache_mode``) are the
    compressor's state cache, needed when ``start > 0``."""
    batch, length = hidden_states.shape[:2]
    ratio = compressor.compress_rate
    coff = compressor.kv_proj.weight.shape[0] // compressor.head_dim
    start_pos = None if state is None else [start] * batch
    out = ops.compressor(
        hidden_states, compressor.kv_proj.weight, compressor.gate_proj.weight, state,
        compressor.position_bias, ratio, start_pos=start_pos, coff=coff, **cache,
    )  # fmt: skip
    first = start // ratio
    new = (start + length) // ratio - first
    compressed = compressor.kv_norm(out[:, :new])
    if new:
        rotate = sys.modules[type(compressor).__module__].apply_rotary_pos_emb
        positions = (torch.arange(new, device=out.device) + first) * ratio
        cos, sin = compressor.rotary_emb(compressed, position_ids=positions.expand(batch, -1),
                                         layer_type="compress")  # fmt: skip
        compressed = rotate(compressed.unsqueeze(1), cos, sin).squeeze(1)
    return compressed


def _cache_layer(module, cache, length):
    """The layer's cache (None without one) and the slot of this call's first token."""
    if cache is None:
        return None, 0
    layer = cache.layers[module.layer_idx]
    base = sys.modules[type(module).__module__].DeepseekV4HCACache
    if module.compressor is not None and not isinstance(layer, base):
        raise ValueError(
            f"past_key_values: DeepSeek-V4's {module.layer_type} layers need the model's own "
            f"cache layers (a DynamicCache of its config), got {type(layer).__name__}"
        )
    start = getattr(layer, "cumulative_length", 0)
    if module.compressor is not None and start and layer.__dict__.get(KEYS) is not layer.keys:
        raise ValueError(
            "past_key_values: the cache was changed since opmesh last wrote it (reordered or "
            "cropped, as beam search and assisted decoding do, or filled by another "
            "implementation); the compressor state opmesh keeps beside it cannot follow"
        )
    return layer, start


def _compressed_keys(module, hidden_states, q_residual, position_ids, layer, start, rows):
    """sparse_flash_mla's compressed-key arguments for a CSA or HCA layer: the compressor's
    entries (all of them so far, with a cache), which of them each row may see, and for CSA the
    indexer's top-k."""
    compressor = module.compressor
    ratio = compressor.compress_rate
    csa = hasattr(compressor, "indexer")
    entries = _entries(compressor, hidden_states, layer, "compressor", 2 if csa else 1, start)
    # The model's rule: a row sees the entries its position has passed; an HCA layer's
    # one-token step (decoding) sees every entry made so far, all of whose tokens precede it.
    step = not csa and hidden_states.shape[1] == 1
    count, residual = rows.entries(ratio, entries.shape[1], start if step else None)
    if entries.shape[1] == 0:
        return {}
    cmp_kv, cu = rows.pack_entries(entries.unsqueeze(2), count)
    call = dict(cmp_kv=cmp_kv, cmp_ratio=ratio, cmp_mask_mode=3, cmp_residual_kv=residual)
    if cu is None:
        call["seqused_cmp_kv"] = count
    else:
        call |= dict(cu_seqlens_cmp_kv=cu)
    if csa:
        call["cmp_sparse_indices"] = _indexer(
            compressor.indexer, hidden_states, q_residual, position_ids, layer, start, rows,
            count, residual,
        )  # fmt: skip
    return call


def _indexer(indexer, hidden_states, q_residual, position_ids, layer, start, rows, count,
             residual):  # fmt: skip
    """The CSA indexer's top-k compressed entries per query (``-1`` past the ones it sees), by
    lightning_indexer over its own compressed keys. Integer indices carry no gradient, as in the
    model's eager path."""
    with torch.no_grad():
        keys = _entries(indexer, hidden_states, layer, "indexer", 2, start)
        q, weights = index_queries(indexer, hidden_states, q_residual, position_ids)
        packed_keys, cu = rows.pack_entries(keys.unsqueeze(2), count)
        call = dict(
            sparse_count=min(indexer.index_topk, keys.shape[1]), cmp_ratio=indexer.compress_rate,
            cmp_residual_key=residual,
        )  # fmt: skip
        if cu is None:
            call["actual_seq_lengths_key"] = count
        else:
            plan = rows.plan
            call |= dict(
                actual_seq_lengths_query=plan.cu_q[1:], actual_seq_lengths_key=cu[1:],
                layout_query="TND", layout_key="TND",
            )  # fmt: skip
        picked, _ = ops.lightning_indexer(
            rows.pack_queries(q), packed_keys, rows.pack_queries(weights), **call
        )
        return picked


def _entries(compressor, hidden_states, layer, name, coff, start):
    """A compressor module's entries ``[B, C, D]`` (:func:`compress`). Without a cache: the
    whole windows of the call. With one: every entry so far, the new ones appended to the cache
    layer's list as the eager path appends them."""
    if layer is None:
        return compress(compressor, hidden_states)
    ratio = compressor.compress_rate
    if layer.entry_count[name] != start // ratio:
        raise ValueError(
            f"past_key_values: the cache holds {layer.entry_count[name]} compressed entries, "
            f"but its {start} tokens make {start // ratio}: it was filled by another attention "
            "implementation or edited"
        )
    state = _state(layer, name, hidden_states, 2 * coff * compressor.head_dim, coff * ratio,
                   start)  # fmt: skip
    table = torch.arange(1, hidden_states.shape[0] + 1, dtype=torch.int32)
    compressed = compress(compressor, hidden_states, start, state, state_block_table=table,
                          cache_mode=2)  # fmt: skip
    return layer.update_compressor_states(name, compressed)


def _state(layer, name, x, width, block, start):
    """The compressor state ring of one compressor on a cache layer: ``[B + 1, block, width]``
    float32, block b + 1 for row b (block 0 is no block). A call from slot 0 starts a new one;
    a later call needs the ring of the calls before it."""
    states = layer.__dict__.setdefault(STATE, {})
    ring = states.get(name)
    shape = (x.shape[0] + 1, block, width)
    if start == 0 or ring is None or tuple(ring.shape) != shape:
        if start != 0:
            raise ValueError(
                f"past_key_values: the cache holds {start} tokens of a DeepSeek-V4 layer but "
                "not the compressor state opmesh keeps: it was filled by another attention "
                "implementation, or its batch changed"
            )
        ring = torch.zeros(shape, dtype=torch.float32, device=x.device)
        states[name] = ring
    return ring


class _Packed(NamedTuple):
    q_batch: torch.Tensor  # the batch row and slot of each packed query, sequence by sequence
    q_pos: torch.Tensor
    cu_q: torch.Tensor  # int32 cumulative query counts per sequence
    k_batch: torch.Tensor  # the same for the window's keys
    k_pos: torch.Tensor
    cu_k: torch.Tensor


class _Rows:
    """The sequences of a call, with the position of each one's last query, from which the
    compressed entries it may see follow. Without padding: the batch rows as they are (BSND).
    With padding: each row's real tokens packed as one sequence (TND), and each run of padded
    queries at consecutive positions as a sequence of no window keys. A padded query sees the
    compressed entries its position has passed, as in the model's eager path, where those
    entries reach the real tokens through the padded slots' hidden states."""

    def __init__(self, packed: _Packed | None, last: torch.Tensor, row: torch.Tensor):
        self.plan = packed  # None: whole rows (BSND)
        self.last = last  # [sequences] position of the last query (-1: no query)
        self.row = row  # [sequences] the batch row of each sequence

    @classmethod
    def read(cls, mask, position_ids, batch, length, module) -> _Rows:
        positions = position_ids.expand(batch, length)
        plan = None
        if mask is not None:
            plan = _plan(_visible(mask), batch, True, module.sliding_window, None)
            if plan is None:
                raise ValueError(
                    "attention_mask: DeepSeek-V4 on opmesh takes the model's sliding-window "
                    "causal mask over padded rows; this mask is another pattern"
                )
            if plan.whole_rows:
                plan = None
        if plan is None:
            _check_steps(positions, None)
            return cls(None, positions[:, -1], torch.arange(batch, device=positions.device))
        q_positions = positions[plan.q_batch, plan.q_pos]
        _check_steps(q_positions, plan.q_seq)
        last = torch.full((plan.cu_q.numel() - 1,), -1, dtype=positions.dtype,
                          device=positions.device)  # fmt: skip
        last.scatter_reduce_(0, plan.q_seq, q_positions, "amax")
        # The row of each sequence: that of its first key (every sequence has keys: its
        # queries' own keys are real).
        row = plan.k_batch[plan.cu_k[:-1].long().clamp(max=plan.k_batch.numel() - 1)]
        real = torch.zeros(batch, length, dtype=torch.bool, device=positions.device)
        real[plan.q_batch, plan.q_pos] = True
        pad_batch, pad_pos = (~real).nonzero(as_tuple=True)
        pad_positions = positions[pad_batch, pad_pos]
        starts = torch.ones_like(pad_batch, dtype=torch.bool)
        starts[1:] = (
            (pad_batch[1:] != pad_batch[:-1])
            | (pad_pos[1:] != pad_pos[:-1] + 1)
            | (pad_positions[1:] != pad_positions[:-1] + 1)
        )
        run = starts.cumsum(0) - 1
        runs = int(starts.sum())
        run_last = last.new_full((runs,), -1).scatter_reduce_(0, run, pad_positions, "amax")
        run_sizes = torch.bincount(run, minlength=runs).to(plan.cu_q.dtype)
        packed = _Packed(
            torch.cat([plan.q_batch, pad_batch]), torch.cat([plan.q_pos, pad_pos]),
            torch.cat([plan.cu_q, plan.cu_q[-1] + run_sizes.cumsum(0)]),
            plan.k_batch, plan.k_pos, torch.cat([plan.cu_k, plan.cu_k[-1].repeat(runs)]),
        )  # fmt: skip
        return cls(packed, torch.cat([last, run_last]), torch.cat([row, pad_batch[starts]]))

    def entries(self, ratio, available, slot=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence: how many compressed entries its last query may see and the original
        tokens past the last of them (``cmp_residual_kv``); ``slot``: the last query's slot
        stands for every sequence's position."""
        last = self.last if slot is None else torch.full_like(self.last, slot)
        seen = (last + 1).clamp(min=0)
        count = seen // ratio
        if bool((count > available).any()):
            raise ValueError(
                f"position_ids: a position reaches compressed entry {int(count.max()) - 1}, "
                f"but the layer has compressed {available} entries (positions must count the "
                "tokens before them)"
            )
        return count, seen - count * ratio

    def pack_entries(self, entries: torch.Tensor, count: torch.Tensor):
        """``entries [B, C, ...]`` as the call takes them: as they are (BSND) or each sequence's
        first ``count`` packed (TND), with the cumulative counts."""
        if self.plan is None:
            return entries, None
        starts = torch.cumsum(count, 0) - count
        total = int(count.sum())
        seq = torch.repeat_interleave(torch.arange(count.numel(), device=count.device), count)
        index = torch.arange(total, device=count.device) - starts[seq]
        cu = torch.cat([count.new_zeros(1), count.cumsum(0)]).int()
        return entries[self.row[seq], index], cu

    def pack_queries(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, S, ...]`` per query, as the call takes it."""
        return x if self.plan is None else x[self.plan.q_batch, self.plan.q_pos]

    def attend(self, q, ori, call) -> torch.Tensor:
        """sparse_flash_mla over these sequences: ``q [B, S, H, D]``, ``ori [B, L, 1, D]``;
        returns ``[B, S, H, D]`` (zeros for padded queries)."""
        if self.plan is None:
            return ops.sparse_flash_mla(q, ori_kv=ori, **call)[0]
        plan = self.plan
        out, _ = ops.sparse_flash_mla(
            self.pack_queries(q), ori_kv=ori[plan.k_batch, plan.k_pos], cu_seqlens_q=plan.cu_q,
            cu_seqlens_ori_kv=plan.cu_k, layout_q="TND", layout_kv="TND", **call,
        )  # fmt: skip
        full = out.new_zeros(q.shape)
        return full.index_put((plan.q_batch, plan.q_pos), out)


def _check_steps(positions: torch.Tensor, sequence: torch.Tensor | None) -> None:
    """Positions rise by one from query to query of a sequence (``sequence``: the sequence of
    each packed query; None: each row of ``positions [B, S]`` is one)."""
    if sequence is None:
        steps_ok = bool((positions.diff(dim=-1) == 1).all())
    else:
        same = sequence[1:] == sequence[:-1]
        steps_ok = bool(((positions.diff() == 1) | ~same).all())
    if not steps_ok:
        raise ValueError(
            "position_ids: DeepSeek-V4 on opmesh needs the positions of a row's tokens to rise "
            "by one (packed sequences are not taken)"
        )
