"""opmesh as the attention of Hugging Face transformers models: tiny random models built here
(no downloads) give the logits, loss, gradients and greedy generations of transformers' own
eager attention, on padded batches (only real tokens compared), packed sequences and static
caches; what opmesh cannot honour is refused by name."""

import pytest
import torch
import torch._dynamo.testing
from conftest import assert_raises_named

transformers = pytest.importorskip("transformers")

import opmesh.integrations.transformers as opmesh_hf  # noqa: E402

opmesh_hf.register()

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
TWO_KINDS = ["sliding_attention", "full_attention"]


def tiny(name):
    """A 2-layer random configuration of each family: GQA 4/2 (DeepSeek-V3.2: MLA keys per
    head), sliding windows shorter than the test sequences, sinks, softcap, a top-4 indexer
    (with 8 heads, so that few keys score exactly 0 after the relu and tie)."""
    t = transformers
    if name == "llama":
        return t.LlamaConfig(**COMMON, intermediate_size=96, num_key_value_heads=2)
    if name == "qwen3":
        return t.Qwen3Config(
            **COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=16,
            use_sliding_window=True, sliding_window=5, max_window_layers=0, layer_types=TWO_KINDS,
        )  # fmt: skip
    if name == "gpt_oss":
        return t.GptOssConfig(
            **COMMON, intermediate_size=32, num_key_value_heads=2, head_dim=16,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=4, layer_types=TWO_KINDS,
        )  # fmt: skip
    if name == "gemma2":
        return t.Gemma2Config(
            **COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=16, sliding_window=4,
            attn_logit_softcapping=5.0, final_logit_softcapping=None, layer_types=TWO_KINDS,
        )  # fmt: skip
    if name == "deepseek_v4":
        return deepseek_v4_config()
    dsa = t.GlmMoeDsaConfig if name == "glm_moe_dsa" else t.DeepseekV32Config
    extra = dict(indexer_types=["full", "shared"]) if name == "glm_moe_dsa" else {}
    return dsa(
        **extra,
        **COMMON, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        index_n_heads=8, index_head_dim=16, index_topk=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1,
    )  # fmt: skip


def deepseek_v4_config(**overrides):
    """DeepSeek-V4's three layer kinds (sliding window, CSA, HCA) with a window, compression
    rates and a top-k small enough for the test sequences to use them all; 8 indexer heads, so
    that few compressed entries score exactly 0 after the relu and tie."""
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    config = dict(
        COMMON, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
        o_lora_rank=16, o_groups=2, layer_types=kinds, sliding_window=4, index_topk=2,
        index_n_heads=8, index_head_dim=16, intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        max_position_embeddings=256,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    )  # fmt: skip
    return transformers.DeepseekV4Config(**(config | overrides))


# GLM-MoE-DSA: DeepSeek-V3.2's attention with the second layer reusing the first's top-k.
MODELS = ["llama", "qwen3", "gpt_oss", "gemma2", "deepseek_v32", "glm_moe_dsa", "deepseek_v4"]


def build(name, dtype=torch.float32):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny(name), dtype=dtype).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("sinks"):  # gpt-oss initialises its sinks to zero
                p.normal_()
    return model


def batch(rows=3, length=13, side="left"):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    for r, pad in enumerate([0, 3, 7][:rows]):
        if side == "left":
            mask[r, :pad] = 0
        else:
            mask[r, length - pad :] = 0
    return ids, mask


def run(model, impl, fn):
    model.set_attn_implementation(impl)
    return fn(model)


def close(a, b, tol):
    assert a.shape == b.shape
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol * max(1.0, b.double().abs().max().item()), err


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_logits_on_a_padded_batch_match_eager(name, side):
    model = build(name)
    ids, mask = batch(side=side)

    def logits(m):
        with torch.no_grad():
            return m(ids, attention_mask=mask).logits[mask.bool()]

    close(run(model, "opmesh", logits), run(model, "eager", logits), 2e-5)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_matches_eager_token_for_token(name, cache):
    if name == "deepseek_v4" and cache == "static":
        pytest.skip("transformers' deepseek_v4 has no static cache")
    model = build(name)
    ids, mask = batch()

    def generate(m):
        with torch.no_grad():
            return m.generate(
                ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                cache_implementation=cache, pad_token_id=0,
            )  # fmt: skip

    assert torch.equal(run(model, "opmesh", generate), run(model, "eager", generate))


@pytest.mark.parametrize("name", MODELS)
def test_loss_and_every_gradient_match_eager_in_training(name):
    model = build(name).train()
    ids, mask = batch(side="right")
    labels = ids.masked_fill(mask == 0, -100)

    def step(m):
        m.zero_grad()
        loss = m(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        return loss.detach(), grads

    loss, grads = run(model, "opmesh", step)
    loss_ref, grads_ref = run(model, "eager", step)
    close(loss, loss_ref, 1e-5)
    assert grads.keys() == grads_ref.keys()
    for n in grads_ref:
        close(grads[n], grads_ref[n], 1e-4)
    if name == "gpt_oss":
        assert any(n.endswith("sinks") for n in grads)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_packed_sequences_attend_within_their_own_sequence(name):
    model = build(name)
    ids, _ = batch(rows=2, length=12)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(12))])
    # transformers reads packing from the position ids when there is no 2-D mask and no cache.

    def logits(m):
        with torch.no_grad():
            return m(ids, position_ids=positions, use_cache=False).logits

    packed = run(model, "opmesh", logits)
    close(packed, run(model, "eager", logits), 2e-5)
    alone = run(model, "opmesh", lambda m: m(ids[:1, 5:], use_cache=False).logits)
    close(packed[:1, 5:], alone.detach(), 2e-5)


def test_a_bf16_prefill_without_padding_matches_sdpa():
    model = build("llama", torch.bfloat16)
    ids = torch.randint(
        0, COMMON["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(3)
    )

    def logits(m):
        with torch.no_grad():
            return m(ids).logits.float()

    close(run(model, "opmesh", logits), run(model, "sdpa", logits), 3e-2)


def test_dropout_in_training_is_refused():
    config = tiny("llama")
    config.attention_dropout = 0.1
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    model.set_attn_implementation("opmesh")
    assert_raises_named(ValueError, "dropout", lambda: model(torch.zeros(1, 4, dtype=torch.long)))


def test_any_other_boolean_mask_runs_as_sparse_attention():
    """A prefix seen both ways (as prefix-LM masks are) is no causal pattern: each query then
    attends to the keys its mask row shows, and the logits are transformers' own."""
    model = build("llama")
    ids, _ = batch(rows=2, length=10)
    prefix = torch.ones(10, 10, dtype=torch.bool).tril()
    prefix[:4, :4] = True
    custom = prefix.expand(2, 1, 10, 10)

    def logits(m):
        with torch.no_grad():
            return m(ids, attention_mask=custom).logits

    close(run(model, "opmesh", logits), run(model, "sdpa", logits), 2e-5)


def test_what_the_kernels_cannot_take_is_refused_by_name():
    model = build("llama")
    model.set_attn_implementation("opmesh")
    ids = torch.zeros(1, 6, dtype=torch.long)
    bias = torch.zeros(1, 1, 6, 6)
    bias[..., 0] = 0.5
    assert_raises_named(ValueError, "attention_mask", lambda: model(ids, attention_mask=bias))


def sharpened(model, factor=200.0):
    """The model with its query projections scaled up: a random model's scores are about 0.03,
    where a softcap of 5 changes nothing; scaled, they reach the cap."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("q_proj.weight"):
                p.mul_(factor)
    return model


def test_a_softcap_with_any_other_mask_matches_eager():
    """Gemma 2's softcap on the sparse path (a mask that is no causal pattern), with scores
    large enough for the cap to bind."""
    model = sharpened(build("gemma2"))
    ids, _ = batch(rows=2, length=10)
    prefix = torch.ones(10, 10, dtype=torch.bool).tril()
    prefix[:4, :4] = True
    # Additive, as eager attention takes it (it adds a boolean mask as 0 / 1).
    custom = torch.zeros(2, 1, 10, 10).masked_fill(~prefix, torch.finfo(torch.float32).min)

    def logits(m):
        with torch.no_grad():
            return m(ids, attention_mask=custom).logits

    close(run(model, "opmesh", logits), run(model, "eager", logits), 2e-5)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt_oss", "gemma2"])
def test_compiled_generation_with_a_static_cache_matches_eager(name):
    """generate() with a static cache compiles the decoding forward (fullgraph), whose masks go
    to the sparse path: windows, sinks and the softcap there, token for token as eager."""
    model = sharpened(build(name), 30.0)
    ids, mask = batch()
    compiled = transformers.CompileConfig(fullgraph=True, dynamic=False)
    compiled._compile_all_devices = True  # transformers compiles on accelerators only otherwise

    def generate(m, compile_config=None):
        with torch.no_grad():
            return m.generate(
                ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                cache_implementation="static", compile_config=compile_config,
            )  # fmt: skip

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ours = run(model, "opmesh", lambda m: generate(m, compiled))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert torch.equal(ours, run(model, "eager", generate))


@pytest.mark.parametrize("padded", [False, True])
def test_a_compiled_forward_is_one_graph_and_matches_eager(padded):
    model = build("qwen3")
    ids, mask = batch()
    if not padded:
        mask = torch.ones_like(mask)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    model.set_attn_implementation("opmesh")
    compiled = torch.compile(
        lambda i, m: model(i, attention_mask=m, use_cache=False).logits,
        backend=counter,
        fullgraph=True,
    )
    with torch.no_grad():
        ours = compiled(ids, mask)[mask.bool()]
    assert counter.frame_count == 1
    reference = run(model, "eager", lambda m: m(ids, attention_mask=mask).logits.detach())
    close(ours, reference[mask.bool()], 2e-5)


def test_dsa_indices_of_the_wrong_shape_are_refused():
    q = torch.randn(1, 2, 5, 8)
    wrong = torch.zeros(1, 4, 2, dtype=torch.int32)
    assert_raises_named(
        ValueError,
        "indices",
        lambda: opmesh_hf.attention_forward(torch.nn.Module(), q, q, q, None, indices=wrong),
    )


def test_register_twice_changes_nothing():
    from transformers import AttentionInterface

    opmesh_hf.register()
    assert AttentionInterface._global_mapping["opmesh"] is opmesh_hf.attention_forward


def indexer_picks(model, ids, mask):
    """The logits, and each DSA indexer's output, of one forward."""
    picks = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: picks.append(out))
        for m in model.modules()
        if type(m).__name__ == "DeepseekV32Indexer"
    ]
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    for hook in hooks:
        hook.remove()
    return logits, picks


@pytest.mark.parametrize("padded", [True, False])
def test_the_lightning_indexer_selects_what_the_model_selects(padded):
    """The first layer's indexer sees the same inputs both ways: the same keys among those each
    token sees (ours lists -1 where it sees fewer than index_topk; the model lists hidden keys,
    which the attention then masks). Later layers' inputs differ by rounding, which can swap
    near-equal scores, so the whole model is compared with a top-k that takes every key."""
    model = build("deepseek_v32")
    model.set_attn_implementation("opmesh")
    ids, mask = batch()
    if not padded:  # every row one whole sequence: the indexer runs on BSND as it is
        mask = torch.ones_like(mask)
    _, (theirs, *_) = indexer_picks(model, ids, mask)
    assert opmesh_hf.use_lightning_indexer(model) == 2
    assert opmesh_hf.use_lightning_indexer(model) == 2  # again: nothing changes
    _, (ours, *_) = indexer_picks(model, ids, mask)
    real = mask.bool()
    visible = real[:, None, :] & torch.ones(13, 13, dtype=torch.bool).tril()
    assert ours.shape == theirs.shape == (3, 13, 4)
    for b, i in real.nonzero().tolist():
        expected = {j for j in theirs[b, i].tolist() if visible[b, i, j]}
        assert set(ours[b, i].tolist()) - {-1} == expected, (b, i)
    assert (ours[~real] == -1).all()


@pytest.mark.parametrize("padded", [True, False])
def test_a_dsa_model_on_the_lightning_indexer_matches_eager(padded):
    config = tiny("deepseek_v32")
    config.index_topk = 32  # every key the tokens see, in whatever order
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.load_state_dict(model.state_dict())
    reference.set_attn_implementation("eager")
    model.set_attn_implementation("opmesh")
    opmesh_hf.use_lightning_indexer(model)
    ids, mask = batch()
    if not padded:
        mask = torch.ones_like(mask)
    ours, picks = indexer_picks(model, ids, mask)
    assert all(p.shape[-1] == 13 and (p == -1).any() for p in picks)  # the opmesh indexer ran
    theirs, _ = indexer_picks(reference, ids, mask)
    close(ours[mask.bool()], theirs[mask.bool()], 2e-5)

    def generate(m):
        with torch.no_grad():
            return m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              pad_token_id=0)  # fmt: skip

    assert torch.equal(generate(model), generate(reference))


def test_the_lightning_indexer_needs_a_dsa_model():
    assert_raises_named(
        ValueError, "model", lambda: opmesh_hf.use_lightning_indexer(build("llama"))
    )


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_dsa_attention_absorbed_into_the_latent_matches_eager(cache):
    model, reference = build("deepseek_v32"), build("deepseek_v32")
    reference.set_attn_implementation("eager")
    model.set_attn_implementation("opmesh")
    assert opmesh_hf.absorb_mla(model) == opmesh_hf.absorb_mla(model) == 2
    forward = model.model.layers[0].self_attn.forward
    assert forward.__func__ is opmesh_hf._absorbed_attention_forward
    ids, mask = batch()

    def logits(m):
        with torch.no_grad():
            return m(ids, attention_mask=mask).logits[mask.bool()]

    close(logits(model), logits(reference), 2e-5)

    def generate(m):
        with torch.no_grad():
            return m.generate(
                ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                cache_implementation=cache, pad_token_id=0,
            )  # fmt: skip

    assert torch.equal(generate(model), generate(reference))


def test_dsa_attention_absorbed_into_the_latent_trains_as_eager():
    model, reference = build("deepseek_v32").train(), build("deepseek_v32").train()
    reference.set_attn_implementation("eager")
    model.set_attn_implementation("opmesh")
    opmesh_hf.absorb_mla(model)
    ids, mask = batch(side="right")
    labels = ids.masked_fill(mask == 0, -100)
    losses, grads = [], []
    for m in (model, reference):
        loss = m(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    close(losses[0], losses[1], 1e-5)
    assert grads[0].keys() == grads[1].keys() and any("kv_b_proj" in n for n in grads[0])
    for n in grads[1]:
        close(grads[0][n], grads[1][n], 1e-4)


def test_absorbing_needs_a_dsa_model():
    assert_raises_named(ValueError, "model", lambda: opmesh_hf.absorb_mla(build("llama")))


def pattern_of(plan, batch, q_len, kv_len, causal, window):
    """The mask a plan stands for, built the long way: every pair of a query and a key of one
    sequence, kept by the key's rank against the query's diagonal."""
    expected = torch.zeros(batch, q_len, kv_len, dtype=torch.bool)
    for s in range(plan.cu_q.numel() - 1):
        queries = range(plan.cu_q[s], plan.cu_q[s + 1])
        keys = range(plan.cu_k[s], plan.cu_k[s + 1])
        for r, t in enumerate(queries):
            diagonal = r + len(keys) - len(queries)
            for c, j in enumerate(keys):
                if causal:
                    seen = c <= diagonal and (window is None or c > diagonal - window)
                else:
                    seen = window is None or abs(c - diagonal) <= window
                if seen:
                    expected[plan.q_batch[t], plan.q_pos[t], plan.k_pos[j]] = True
    return expected


@pytest.mark.parametrize("causal, window", [(True, None), (True, 3), (False, None), (False, 2)])
def test_masks_are_read_into_sequences_exactly(causal, window):
    """Padding on either side, packing and a cache offset give plans; a plan is accepted only
    if it stands for the mask bit for bit, also after any one bit of the mask flips."""
    from transformers import masking_utils as mu

    if causal:
        function = mu.causal_mask_function
        if window is not None:
            function = mu.sliding_window_causal_mask_function(window)
    else:
        function = mu.bidirectional_mask_function
        if window is not None:
            function = mu.sliding_window_bidirectional_mask_function(window)
    gen = torch.Generator().manual_seed(5)
    padding = torch.ones(3, 9, dtype=torch.bool)
    padding[1, :3] = False
    padding[2, 6:] = False
    masks = [
        opmesh_hf.attention_mask(3, 9, 9, mask_function=function, attention_mask=padding),
        opmesh_hf.attention_mask(3, 4, 9, q_offset=5, mask_function=function,
                                 attention_mask=padding, allow_is_causal_skip=False),
    ]  # fmt: skip
    if causal:
        segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]])
        packed = mu.and_masks(function, mu.packed_sequence_mask_function(segments))
        masks.append(
            opmesh_hf.attention_mask(1, 9, 9, mask_function=packed, allow_is_causal_skip=False)
        )
    for mask in masks:
        visible = mask[:, 0]
        batch, q_len, kv_len = visible.shape
        positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]]) if batch == 1 else None
        plan = opmesh_hf._plan(visible, batch, causal, window, positions)
        assert plan is not None
        assert torch.equal(pattern_of(plan, batch, q_len, kv_len, causal, window), visible)
        for _ in range(12):
            flipped = visible.clone()
            b, i, j = (int(torch.randint(n, (1,), generator=gen)) for n in visible.shape)
            flipped[b, i, j] = ~flipped[b, i, j]
            plan = opmesh_hf._plan(flipped, batch, causal, window, positions)
            if plan is not None:
                assert torch.equal(pattern_of(plan, batch, q_len, kv_len, causal, window), flipped)


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_bidirectional_attention_matches_sdpa(window, padded):
    """An encoder's attention (is_causal False), full or in a window of `window` keys either
    side, with and without padding, against SDPA with transformers' own mask."""
    from transformers import masking_utils as mu

    function = mu.bidirectional_mask_function
    if window is not None:
        function = mu.sliding_window_bidirectional_mask_function(window)
    padding = torch.ones(2, 9, dtype=torch.bool)
    if padded:
        padding[1, 6:] = False
    mask = opmesh_hf.attention_mask(2, 9, 9, mask_function=function, attention_mask=padding)
    if window is None and not padded:
        assert mask is None  # transformers drops it: full attention
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 9, 8, generator=gen) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.is_causal = False
    ours, _ = opmesh_hf.attention_forward(module, q, k, v, mask, sliding_window=window)
    full = mu.sdpa_mask(2, 9, 9, mask_function=function, attention_mask=padding,
                        allow_is_causal_skip=False)  # fmt: skip
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=full, enable_gqa=True
    ).transpose(1, 2)
    real = padding
    close(ours[real], reference[real].float(), 1e-5)
