"""transformers' DeepSeek-V4 (``deepseek_v4``) on opmesh after ``register()``: tiny random models
(a sliding-window, a CSA and an HCA layer) give eager's logits, greedy tokens and gradients, on
padded batches, chunked prefill and decoding with transformers' cache, with no dense bias over
the window and the compressed entries; what the path cannot honour is refused by name."""

import pytest
import torch
from conftest import assert_raises_named

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("this transformers has no deepseek_v4", allow_module_level=True)

from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling  # noqa: E402

import opmesh.integrations.deepseek_v4 as opmesh_v4  # noqa: E402
import opmesh.integrations.transformers as opmesh_hf  # noqa: E402

opmesh_hf.register()

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def config(**overrides):
    """Window 8, compression every 4 (CSA) and 16 (HCA) tokens, the indexer's top-4; 8 indexer
    heads, so that few compressed entries score exactly 0 after the relu and tie (the model's
    top-k orders ties as torch.topk does, opmesh by position)."""
    values = dict(
        vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_lora_rank=16, o_groups=2,
        layer_types=KINDS, sliding_window=8, index_topk=4, index_n_heads=8, index_head_dim=16,
        intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=256,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    )  # fmt: skip
    return transformers.DeepseekV4Config(**(values | overrides))


def build(dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(**overrides), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_()
    return model.eval()


def prompts(rows=3, length=21, pads=(0, 5, 13)):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    for r, pad in enumerate(pads[:rows]):
        mask[r, :pad] = 0
    return ids, mask


def on(model, impl):
    model.set_attn_implementation(impl)
    return model


def worst(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1)).item()


def test_greedy_generation_of_32_tokens_equals_eager_on_a_left_padded_batch():
    model = build()
    model.generation_config.eos_token_id = None  # random weights: all 32 tokens, no early end
    ids, mask = prompts()
    out = {}
    for impl in ("eager", "opmesh"):
        with torch.no_grad():
            out[impl] = on(model, impl).generate(
                ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
    assert torch.equal(out["opmesh"].sequences, out["eager"].sequences)
    for got, want in zip(out["opmesh"].logits, out["eager"].logits, strict=True):
        assert worst(got, want) < 2e-5


@pytest.mark.parametrize("positions", ["slots", "from_the_mask"])
def test_a_left_padded_batch_equals_eager_on_the_same_batch(positions):
    """The compressors' windows follow slots (padding included) and the entries a row sees
    follow its positions, as in eager; only real tokens are compared."""
    model = build()
    ids, mask = prompts(length=37)
    kwargs = {}
    if positions == "from_the_mask":  # as generate() makes them: padded slots at position 1
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits = {}
    for impl in ("eager", "opmesh"):
        with torch.no_grad():
            logits[impl] = on(model, impl)(ids, attention_mask=mask, **kwargs).logits
    real = mask.bool()
    assert worst(logits["opmesh"][real], logits["eager"][real]) < 2e-5


def test_chunked_prefill_and_decoding_with_the_cache_equal_eager():
    """Prefill in chunks that end inside compression windows, then one token at a time: the
    compressor state kept beside the cache finishes the open windows as eager's buffer does."""
    model = build()
    ids, _ = prompts(rows=2, length=40, pads=(0, 0))
    cuts = [0, 11, 17, 33, 34, 35, 36, 40]
    logits = {}
    for impl in ("eager", "opmesh"):
        cache = transformers.DynamicCache(config=model.config)
        steps = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            with torch.no_grad():
                steps.append(on(model, impl)(ids[:, a:b], past_key_values=cache).logits)
        logits[impl] = torch.cat(steps, 1)
        counts = [layer.entry_count.get("compressor") for layer in cache.layers[1:]]
        assert counts == [40 // 4, 40 // 16]
    assert worst(logits["opmesh"], logits["eager"]) < 2e-5


def test_training_reaches_every_weight_of_the_compressors_as_eager():
    model = build().train()
    ids, mask = prompts(length=37, pads=(0, 6, 11))
    ids, mask = ids.flip(-1), mask.flip(-1)  # right padding, as training batches come
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for impl in ("eager", "opmesh"):
        model.zero_grad()
        on(model, impl)(ids, attention_mask=mask, labels=labels).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["opmesh"].keys() == grads["eager"].keys()
    for name, want in grads["eager"].items():
        assert worst(grads["opmesh"][name], want) < 1e-4, name
    assert any("compressor.kv_proj" in n for n in grads["opmesh"])
    assert any("compressor.position_bias" in n for n in grads["opmesh"])
    assert any(n.endswith("sinks") for n in grads["opmesh"])


def test_bf16_logits_are_as_close_to_float32_as_eager_bf16():
    # The indexer keeps every compressed entry (at most 37 // 4 of them): with the top-4, bf16
    # rounding may tip a near tie in the indexer's scores, and one query then attends to other
    # entries than float32's, an error that measures the tie, not the arithmetic (seen on an
    # AVX2-only CPU: one query's logits off by 0.053 with opmesh, every other within eager's
    # 0.008). The top-4 selection itself is checked against eager in float32 by the tests above.
    ids, mask = prompts(length=37)
    reference = build(index_topk=16)
    with torch.no_grad():
        want = on(reference, "eager")(ids, attention_mask=mask).logits[mask.bool()]
    model = build(torch.bfloat16, index_topk=16)
    err = {}
    for impl in ("eager", "opmesh"):
        with torch.no_grad():
            got = on(model, impl)(ids, attention_mask=mask).logits[mask.bool()]
        err[impl] = worst(got, want)
    # opmesh rounds the compressor's sum and the attention once (float32 inside); eager rounds
    # each step to bf16.
    assert err["opmesh"] <= 1.5 * err["eager"] + 1e-3, err


def test_no_dense_bias_is_built(monkeypatch):
    """The model's compressors, indexer and eager attention never run: the layers go to the
    opmesh operators."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model's own dense path ran")

    for cls in ("DeepseekV4CSACompressor", "DeepseekV4HCACompressor", "DeepseekV4Indexer"):
        monkeypatch.setattr(getattr(modeling, cls), "forward", refuse)
    monkeypatch.setattr(modeling, "eager_attention_forward", refuse)
    calls = {"sparse_flash_mla": 0, "compressor": 0, "lightning_indexer": 0}
    for name in calls:
        own = getattr(opmesh_v4.ops, name)

        def counted(*args, _own=own, _name=name, **kwargs):
            calls[_name] += 1
            return _own(*args, **kwargs)

        monkeypatch.setattr(opmesh_v4.ops, name, counted)
    model = on(build(), "opmesh")
    ids, mask = prompts()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    # Per forward: 3 attentions, 3 compressors (CSA, its indexer's, HCA), 1 indexer.
    assert calls == {"sparse_flash_mla": 9, "compressor": 9, "lightning_indexer": 3}


def test_what_the_path_cannot_honour_is_refused_by_name():
    model = on(build(), "opmesh")
    ids, _ = prompts(rows=1, length=20, pads=(0,))
    with torch.no_grad():
        packed = torch.cat([torch.arange(12), torch.arange(8)])[None]
        assert_raises_named(ValueError, "position_ids", lambda: model(ids, position_ids=packed))
        holes = torch.ones(1, 1, 20, 20, dtype=torch.bool).tril()
        holes[..., 3] = False  # a key no pattern hides
        with pytest.raises(ValueError, match="^attention_mask"):
            model(ids, attention_mask={"sliding_attention": holes})
        cache = transformers.DynamicCache(config=model.config)
        on(model, "eager")(ids[:, :10], past_key_values=cache)
        on(model, "opmesh")
        assert_raises_named(
            ValueError, "past_key_values", lambda: model(ids[:, 10:], past_key_values=cache)
        )
    # Beam search reorders the cache, which the compressor state cannot follow.
    with torch.no_grad():
        assert_raises_named(
            ValueError, "past_key_values",
            lambda: model.generate(ids, max_new_tokens=4, num_beams=2, pad_token_id=0),
        )  # fmt: skip
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 32)
    assert_raises_named(
        ValueError, "model", lambda: opmesh_hf.attention_forward(attention, q, q, q, None)
    )
    model.train()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    assert_raises_named(ValueError, "dropout", lambda: model(ids))
