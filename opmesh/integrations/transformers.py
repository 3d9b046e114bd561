"""opmesh as an attention implementation of Hugging Face transformers.

After :func:`register`, ``attn_implementation="opmesh"`` (in ``from_pretrained`` or
``model.set_attn_implementation``) runs a model's attention on :func:`opmesh.flash_attn`, and the
top-k sparse attention of DeepSeek-V3.2-style models on :func:`opmesh.sparse_flash_attention`.

Masks: the mask function registered with the attention builds transformers' boolean mask (as the
``"sdpa"`` implementation does, with padded query rows cleared). The attention runs without it
when transformers drops it (no padding, plain causal or full attention). Otherwise the mask is
read once per forward into per-sequence token lists (padding on either side, packed sequences,
static caches) and, if it is exactly the causal, windowed or full pattern over those sequences,
attention runs on the packed real tokens. Any other mask, and any mask inside a compiled graph,
runs as sparse attention of each query over the keys its mask row shows.
See docs/transformers.md.
"""

from __future__ import annotations

import functools
import sys
import types

import torch

from .. import ops
from ._masks import _plan, _visible
from ._paged import PAGED_NAME, paged_attention_forward, set_kv_cache

NAME = "opmesh"


def register(*, kv_cache: str | None = None) -> None:
    """Registers ``"opmesh"`` with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface``, and ``"paged|opmesh"`` for continuous batching (calling it again
    changes nothing but ``kv_cache``). ``kv_cache``: ``"int8"`` or ``"fp8"`` stores continuous
    batching's full-attention keys and values quantized (a byte per element and a float32 scale
    per row, in transformers' own cache memory); None keeps the cache's dtype."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    set_kv_cache(kv_cache)
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)
    AttentionInterface.register(PAGED_NAME, paged_attention_forward)
    _install_deepseek_v4()


def _install_deepseek_v4() -> None:
    """DeepSeek-V4's attention builds a dense bias over its window and compressed entries
    before it calls the attention function; under ``"opmesh"`` its modules run
    :func:`opmesh.integrations.deepseek_v4.attention_forward` instead (any other implementation
    keeps the model's own forward)."""
    try:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling
    except ImportError:  # a transformers without the model
        return
    cls = modeling.DeepseekV4Attention
    if getattr(cls.forward, "_opmesh_own", None) is not None:
        return
    from . import deepseek_v4

    own = cls.forward

    @functools.wraps(own)
    def forward(self, *args, **kwargs):
        if getattr(self.config, "_attn_implementation", None) == NAME:
            return deepseek_v4.attention_forward(self, *args, **kwargs)
        return own(self, *args, **kwargs)

    forward._opmesh_own = own
    cls.forward = forward


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask function of ``"opmesh"``: transformers' boolean ``[B, 1, q, kv]`` mask (None when
    no token is masked beyond the causal or full pattern), with the rows of padded queries
    cleared, so that every visible row belongs to a real token."""
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

    mask = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=causal_mask_function if mask_function is None else mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )
    if mask is None or attention_mask is None or attention_mask.dim() != 2:
        return mask
    padding = prepare_padding_mask(attention_mask.bool(), kv_length, kv_offset)
    positions = torch.arange(q_length, device=padding.device) + q_offset
    real_queries = padding[:, positions.clamp(max=padding.shape[-1] - 1)]
    return mask & real_queries[:, None, :, None]


def attention_forward(
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
    indices: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function of ``"opmesh"``: ``query [B, H, Sq, D]``, ``key``/``value``
    ``[B, Hkv, Skv, D/Dv]`` in, ``[B, Sq, H, Dv]`` out (no attention weights).

    Honours the module's causality (``is_causal``), ``scaling``, ``sliding_window``, ``softcap``
    (Gemma 2), ``s_aux`` sinks (gpt-oss) and DSA ``indices`` ``[B, Sq, K]`` (DeepSeek-V3.2).
    """
    if type(module).__name__ == "DeepseekV4Attention":
        # Its mask carries the compressed entries' bias, which this function cannot honour.
        raise ValueError(
            "model: DeepSeek-V4's attention runs on opmesh through its own forward, installed "
            "by opmesh.integrations.transformers.register(); call register() after importing "
            "a transformers that has the model"
        )
    if dropout and module.training:
        raise ValueError(
            f"dropout: opmesh attention has no dropout, got p={dropout} in training; set the "
            "config's attention_dropout to 0"
        )
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    sinks = None if s_aux is None else s_aux.float()
    mask = None if attention_mask is None else _visible(attention_mask)
    if indices is not None:
        return _sparse(query, key, value, mask, indices, scaling, sinks, causal, softcap), None
    mode, left, right = _mask_mode(causal, sliding_window)
    common = dict(
        softmax_scale=scaling, sinks=sinks, softcap=softcap or None, mask_mode=mode,
        win_left=left, win_right=right,
    )  # fmt: skip
    if mask is None:
        q_len = query.shape[2]
        if causal and 1 < q_len < key.shape[2]:
            # transformers drops the mask for a prefill into an empty static cache: the queries
            # are the first keys, the rest of the cache is unwritten.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        out, _ = ops.flash_attn(
            query, key, value, layout_q="BNSD", layout_kv="BNSD", layout_out="BSND", **common
        )
        return out, None
    plan = None
    if not torch.compiler.is_compiling():
        plan = _plan(mask, query.shape[0], causal, sliding_window, kwargs.get("position_ids"))
    if plan is None:
        # Any other mask, and every mask in a compiled graph (reading it into sequences needs
        # the host): each query attends to the keys its mask row shows, as sparse attention.
        return _sparse(query, key, value, mask, None, scaling, sinks, False, softcap), None
    q = query.transpose(1, 2)[plan.q_batch, plan.q_pos]
    k = key.transpose(1, 2)[plan.k_batch, plan.k_pos]
    v = value.transpose(1, 2)[plan.k_batch, plan.k_pos]
    out, _ = ops.flash_attn(
        q, k, v, cu_seqlens_q=plan.cu_q, cu_seqlens_kv=plan.cu_k, layout_q="TND", **common
    )
    batch, heads, q_len = query.shape[:3]
    full = out.new_zeros(batch, q_len, heads, out.shape[-1])
    return full.index_put((plan.q_batch, plan.q_pos), out), None


def _mask_mode(causal: bool, window: int | None) -> tuple[int, int, int]:
    """flash_attn's mask for transformers' pattern. A causal window of w keys is the token and
    the w - 1 before it; a bidirectional one reaches w keys either side."""
    if window is None:
        return (3 if causal else 0), -1, -1
    return (4, window - 1, 0) if causal else (4, window, window)


def _shown(mask: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The ``[B, Sq, K]`` indices with -1 for every key the ``[B or 1, Sq, Skv]`` mask hides."""
    selected = indices.long()
    seen = mask.expand(indices.shape[0], -1, -1).gather(-1, selected.clamp(min=0))
    return torch.where(seen & (selected >= 0), selected, -1)


def _sparse(query, key, value, mask, indices, scaling, sinks, causal, softcap=None):
    """Each query over the keys its ``indices [B, Sq, K]`` select (one selection for every
    head; None: every key), restricted to the keys the mask shows it."""
    batch, _, q_len, _ = query.shape
    if indices is None:
        indices = torch.arange(key.shape[2], device=query.device).expand(batch, q_len, -1)
    elif indices.dim() != 3 or indices.shape[:2] != (batch, q_len):
        raise ValueError(
            f"indices: expected [B, Sq, K] = [{batch}, {q_len}, K], got {tuple(indices.shape)}"
        )
    mode = 3 if causal else 0
    if mask is not None:
        indices = _shown(mask, indices)
        mode = 0  # the mask now carries causality, windows and padding
    out, _, _ = ops.sparse_flash_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        indices.to(torch.int32).unsqueeze(2),
        query.shape[-1] ** -0.5 if scaling is None else scaling,
        sparse_mode=mode,
        sinks=sinks,
        softcap=softcap or None,
    )
    return out


def use_lightning_indexer(model: torch.nn.Module) -> int:
    """Makes the DSA indexers of a DeepSeek-V3.2 model (``DeepseekV32Indexer``) score and select
    their top-k keys with :func:`opmesh.lightning_indexer`, the model's scales folded into its
    weights; returns how many it changed.

    The projections, rotary embedding and indexer key cache stay the model's own. The selection
    is the model's up to ties in the score, listed with ``-1`` where a token sees fewer keys than
    ``index_topk``, which the ``"opmesh"`` attention reads; under any other attention
    implementation, inside ``torch.compile``, or with a mask that is not a causal pattern over
    padded or packed sequences, an indexer runs the model's own code."""
    return _replace_forward(model, "DeepseekV32Indexer", _indexer_forward)


def _replace_forward(model, class_name, forward) -> int:
    """Gives every module of that class ``forward`` (once; the model's own stays reachable as
    ``_opmesh_model_forward``) and returns how many there are."""
    changed = 0
    for module in model.modules():
        if type(module).__name__ == class_name:
            if not hasattr(module, "_opmesh_model_forward"):
                module._opmesh_model_forward = module.forward
                module.forward = types.MethodType(forward, module)
            changed += 1
    if not changed:
        raise ValueError(f"model: {type(model).__name__} has no {class_name} module")
    return changed


def _indexer_forward(
    self,
    hidden_states,
    q_resid,
    position_embeddings,
    attention_mask,
    position_ids=None,
    past_key_values=None,
):
    own = self._opmesh_model_forward
    args = (hidden_states, q_resid, position_embeddings, attention_mask, position_ids)
    if (
        getattr(self.config, "_attn_implementation", None) != NAME
        or torch.compiler.is_compiling()
        or attention_mask is None
        or attention_mask.dtype != torch.bool
    ):
        return own(*args, past_key_values=past_key_values)
    plan = _plan(attention_mask, hidden_states.shape[0], True, None, position_ids)
    if plan is None:
        return own(*args, past_key_values=past_key_values)
    with torch.no_grad():
        batch, length, _ = hidden_states.shape
        rotate = sys.modules[type(self).__module__].apply_rotary_pos_emb
        rope, rest = self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim
        q = self.wq_b(q_resid).view(batch, length, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
        (q_rot, q_pass), (k_rot, k_pass) = q.split([rope, rest], -1), k.split([rope, rest], -1)
        q_rot, k_rot = rotate(q_rot, k_rot, *position_embeddings, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1).squeeze(2)
        if past_key_values is not None:
            k = past_key_values.update_indexer(k, self.layer_idx)
        # relu(c * x) = c * relu(x) for c > 0: the model's scales go into the weights.
        scale = self.n_heads**-0.5 * self.softmax_scale
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
        count = min(self.index_topk, k.shape[1])
        if plan.whole_rows:  # each row one sequence of all its slots: BSND, positions are slots
            picked, _ = ops.lightning_indexer(
                q, k.unsqueeze(2), weights * scale, sparse_count=count
            )
            return picked[:, :, 0]
        picked, _ = ops.lightning_indexer(
            q[plan.q_batch, plan.q_pos],
            k[plan.k_batch, plan.k_pos].unsqueeze(1),
            (weights * scale)[plan.q_batch, plan.q_pos],
            actual_seq_lengths_query=plan.cu_q[1:],
            actual_seq_lengths_key=plan.cu_k[1:],
            layout_query="TND",
            layout_key="TND",
            sparse_count=count,
        )
        picked = picked[:, 0].long()  # positions within each sequence's keys, -1 past the end
        first_key = plan.cu_k[:-1].long()[plan.q_seq]
        slots = plan.k_pos[
            (first_key[:, None] + picked.clamp(min=0)).clamp(max=plan.k_pos.numel() - 1)
        ]
        out = torch.full((batch, length, count), -1, dtype=torch.int32, device=q.device)
        out[plan.q_batch, plan.q_pos] = torch.where(picked >= 0, slots, -1).int()
        return out


def absorb_mla(model: torch.nn.Module) -> int:
    """Runs the attention of a DeepSeek-V3.2 model (``DeepseekV32Attention``) on the compressed
    key-value latent, as DeepSeek's own kernels do: the key up-projection folded into the
    queries and the value up-projection applied after attention, so one latent row (with its
    rotary part) serves every head, and :func:`opmesh.sparse_flash_attention` runs in its MLA
    absorb mode (``attention_mode=2``). Returns how many modules it changed.

    transformers expands the latent into keys and values per head first; over the top-k keys of
    every token that makes the attention read ``heads`` times as many rows. Absorbed, the same
    result (up to rounding) reads each selected latent row once for all heads. The projections,
    rotary embedding, cache and indexer stay the model's own; under any other attention
    implementation a module runs the model's own code."""
    return _replace_forward(model, "DeepseekV32Attention", _absorbed_attention_forward)


def _absorbed_attention_forward(
    self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
    position_ids=None, **kwargs,
):  # fmt: skip
    if getattr(self.config, "_attn_implementation", None) != NAME:
        return self._opmesh_model_forward(
            hidden_states, position_embeddings, attention_mask, past_key_values=past_key_values,
            position_ids=position_ids, **kwargs,
        )  # fmt: skip
    if self.training and self.attention_dropout:
        raise ValueError(
            f"dropout: opmesh attention has no dropout, got p={self.attention_dropout} in "
            "training; set the config's attention_dropout to 0"
        )
    modeling = sys.modules[type(self).__module__]
    batch, length = hidden_states.shape[:-1]
    nope, rope, lora = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q = self.q_b_proj(q_resid).view(batch, length, -1, nope + rope).transpose(1, 2)
    q_pass, q_rot = q.split([nope, rope], -1)
    latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([lora, rope], -1)
    latent = self.kv_a_layernorm(latent).view(batch, 1, length, lora)
    k_rot = k_rot.view(batch, 1, length, rope)
    q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, *position_embeddings)
    if past_key_values is not None:
        latent, k_rot = past_key_values.update(latent, k_rot, self.layer_idx)
    picked = self.indexer(
        hidden_states, q_resid, position_embeddings, attention_mask[:, 0, :, :], position_ids,
        past_key_values=past_key_values,
    )  # fmt: skip
    # kv_b_proj's rows are, per head, nope key features then v_head_dim value features.
    up = self.kv_b_proj.weight.view(self.num_heads, nope + self.v_head_dim, lora)
    key_up, value_up = up[:, :nope], up[:, nope:]
    q_latent = torch.einsum("bhsn,hnl->bshl", q_pass, key_up)  # [B, S, H, lora]
    mask = None if attention_mask is None else _visible(attention_mask)
    if mask is not None:
        picked = _shown(mask, picked)
    keys = latent.transpose(1, 2)  # [B, T, 1, lora]: keys and values are the same rows
    out_latent, _, _ = ops.sparse_flash_attention(
        q_latent,
        keys,
        keys,
        picked.to(torch.int32).unsqueeze(2),
        self.scaling,
        query_rope=q_rot.transpose(1, 2),
        key_rope=k_rot.transpose(1, 2),
        sparse_mode=0 if mask is not None else 3,
        attention_mode=2,
    )
    out = torch.einsum("bshl,hvl->bshv", out_latent, value_up)
    return self.o_proj(out.reshape(batch, length, -1)), None
