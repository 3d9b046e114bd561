"""DeepSeek-V4's attention layers of Hugging Face transformers' ``deepseek_v4`` (a tiny random
config: a sliding-window layer, a CSA layer and an HCA layer) against ``sparse_flash_mla``: at
each layer's attention call the eager model hands over its queries, its key/value rows (the
window's original keys, then the compressed entries) and the dense bias it built; the operator
gets the same rows with the V4 masks it implements (the window, the compressed entries a row has
passed, the indexer's top-k, the sinks), and its output and gradients must equal eager's."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import opmesh

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("this transformers has no deepseek_v4", allow_module_level=True)

from transformers import (  # noqa: E402
    AttentionInterface,
    AttentionMaskInterface,
    DeepseekV4Config,
    DeepseekV4Model,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4  # noqa: E402

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def tiny_config(index_topk=4):
    return DeepseekV4Config(
        vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_lora_rank=16, o_groups=2,
        layer_types=LAYERS, sliding_window=8, index_topk=index_topk, index_n_heads=2,
        index_head_dim=16, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=256,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    )  # fmt: skip


def opmesh_call(module, query, key):
    """sparse_flash_mla's arguments for one eager attention call (no cache: prefill from position
    0, so the first S key rows are the window's keys and the rest are compressed entries)."""
    s = query.shape[2]
    ori = key[:, :, :s].transpose(1, 2)  # [B, S, 1, D]
    cmp = key[:, :, s:].transpose(1, 2)  # [B, C, 1, D]
    kwargs = dict(
        ori_kv=ori, ori_mask_mode=4, ori_win_left=module.sliding_window - 1, ori_win_right=0,
        softmax_scale=module.scaling, sinks=module.sinks,
    )  # fmt: skip
    if module.layer_type == "sliding_attention":
        return kwargs | dict(cmp_mask_mode=0)
    ratio = module.config.compress_rates[module.layer_type]
    assert cmp.shape[1] == s // ratio
    kwargs |= dict(cmp_kv=cmp, cmp_ratio=ratio, cmp_mask_mode=3)
    if s % ratio:
        kwargs["cmp_residual_kv"] = [s % ratio] * query.shape[0]
    return kwargs


def indexer_choice(module, bias, s):
    """The CSA indexer's top-k as the eager path used it: the compressed entries its dense bias
    leaves open, per row, padded with -1 (the operator applies the causal frontier itself)."""
    open_ = bias[:, 0, :, s:] == 0  # [B, S, C]
    k = module.config.index_topk
    idx = torch.full((*open_.shape[:2], 1, k), -1, dtype=torch.int32)
    for b in range(open_.shape[0]):
        for i in range(s):
            picked = open_[b, i].nonzero().flatten()
            assert len(picked) <= k
            idx[b, i, 0, : len(picked)] = picked.int()
    return idx


@pytest.mark.parametrize("seq", [37, 48])  # with and without a residual
def test_every_layer_kind_equals_eager(seq):
    torch.manual_seed(0)
    model = DeepseekV4Model(tiny_config()).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.sinks.normal_()  # non-trivial sinks
    seen = {}

    def check(module, query, key, value, attention_mask, scaling, **kwargs):
        assert key is value
        want, _ = v4.eager_attention_forward(module, query, key, value, attention_mask, scaling)
        call = opmesh_call(module, query, key)
        if module.layer_type == "compressed_sparse_attention":
            call["cmp_sparse_indices"] = indexer_choice(module, attention_mask, query.shape[2])
        leaves = [query, key, module.sinks]
        q = query.detach().requires_grad_(True)
        kv = key.detach().requires_grad_(True)
        sinks = module.sinks.detach().requires_grad_(True)
        with torch.enable_grad():  # the model runs under no_grad; the check takes gradients
            ours_call = opmesh_call(module, q, kv) | {"sinks": sinks}
            if "cmp_sparse_indices" in call:
                ours_call["cmp_sparse_indices"] = call["cmp_sparse_indices"]
            got = opmesh.sparse_flash_mla(q.transpose(1, 2), **ours_call)[0]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        # Gradients for the same upstream gradient: eager's by autograd, ours by the backward.
        up = torch.randn_like(want)
        ref = [x.detach().requires_grad_(True) for x in leaves]
        # eager's formula reads the module's sinks, groups and mode: a stand-in holds the leaf.
        stand_in = SimpleNamespace(
            sinks=ref[2], num_key_value_groups=module.num_key_value_groups, training=False
        )
        with torch.enable_grad():
            ref_out, _ = v4.eager_attention_forward(
                stand_in, ref[0], ref[1], ref[1], attention_mask, scaling
            )
            want_grads = torch.autograd.grad((ref_out * up).sum(), ref)
            got_grads = torch.autograd.grad((got * up).sum(), [q, kv, sinks])
        for name, a, b in zip(("q", "kv", "sinks"), got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)
        seen[module.layer_type] = seen.get(module.layer_type, 0) + 1
        return want, None

    AttentionInterface.register("v4_check", check)
    # The eager path's dense bias, as eager attention takes it.
    AttentionMaskInterface.register("v4_check", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.config._attn_implementation = "v4_check"
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
    assert seen == {kind: 1 for kind in LAYERS}


def _opmesh_compressed(module, hidden_states):
    """A compressor module's entries computed with opmesh.compressor, then the module's own
    normalisation and rotary embedding (stateless prefill from position 0)."""
    coff = 2 if isinstance(module, v4.DeepseekV4CSACompressor) else 1
    ratio = module.compress_rate
    out = opmesh.compressor(hidden_states, module.kv_proj.weight, module.gate_proj.weight, None,
                            module.position_bias, ratio, coff=coff)  # fmt: skip
    n = hidden_states.shape[1] // ratio
    compressed = module.kv_norm(out[:, :n])
    positions = (torch.arange(n) * ratio).unsqueeze(0).expand(hidden_states.shape[0], -1)
    cos, sin = module.rotary_emb(compressed, position_ids=positions, layer_type="compress")
    return v4.apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin)


def test_the_model_on_opmesh_operators_equals_eager():
    """The tiny model with every V4 attention kernel on opmesh: the compressors' entries from
    opmesh.compressor (the model's norm and rotary embedding after them) and the attention of
    every layer kind from sparse_flash_mla; its output and every parameter's gradient equal the
    eager model's."""
    torch.manual_seed(0)
    eager = DeepseekV4Model(tiny_config())
    with torch.no_grad():
        for layer in eager.layers:
            layer.self_attn.sinks.normal_()
    ours = copy.deepcopy(eager)
    ours.config._attn_implementation = "v4_opmesh"

    def attention(module, query, key, value, attention_mask, scaling, **kwargs):
        call = opmesh_call(module, query, key)
        if module.layer_type == "compressed_sparse_attention":
            call["cmp_sparse_indices"] = indexer_choice(module, attention_mask, query.shape[2])
        return opmesh.sparse_flash_mla(query.transpose(1, 2), **call)[0], None

    AttentionInterface.register("v4_opmesh", attention)
    AttentionMaskInterface.register("v4_opmesh", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    replaced = []
    for layer in ours.layers:
        compressor = getattr(layer.self_attn, "compressor", None)
        if compressor is not None:
            compressor.register_forward_hook(
                lambda m, args, out: (_opmesh_compressed(m, args[0]), out[1])
            )
            replaced.append(type(compressor).__name__)
    assert sorted(replaced) == ["DeepseekV4CSACompressor", "DeepseekV4HCACompressor"]
    ids = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(1))
    outputs = []
    for model in (eager, ours):
        out = model(ids).last_hidden_state
        out.square().sum().backward()
        outputs.append(out)
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-5, rtol=2e-5)
    compared = 0
    for (name, a), (_, b) in zip(eager.named_parameters(), ours.named_parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None or not b.grad.any(), name
            continue
        # float32 through three layers, their experts and the hyper-connections, summed in
        # another order: to 1e-3 of each gradient's largest entry, plus 1e-5 for the gradients
        # that are small by cancellation (a hash-routed gate's, the hyper-connections' scales);
        # a wrong or missing gradient of an attention or compressor weight is off by about its
        # own size, 1e-1 and more here.
        scale = a.grad.abs().max().item()
        torch.testing.assert_close(b.grad, a.grad, atol=1e-3 * scale + 1e-5, rtol=0, msg=name)
        compared += 1
    # The compressors' weights and position biases reach their gradients through opmesh.
    assert any("compressor.kv_proj" in n and p.grad is not None for n, p in ours.named_parameters())
    assert compared > 20
