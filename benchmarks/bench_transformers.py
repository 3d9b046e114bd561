"""Hugging Face transformers models with attn_implementation="opmesh" against "sdpa" and "eager",
in one run: tokens per second of a prefill, of greedy generation and of one training step.

* Llama-shaped (random weights, bf16): hidden 1024, 8 query heads and 2 key heads of dim 128,
  4 layers. Prefill of S tokens; generation of 32 tokens after a prompt of S / 2; one training
  step (forward and backward) on S / 2 tokens.
* DeepSeek-V3.2-shaped (random weights, bf16, top-2048 indexer): prefill of S tokens. "opmesh"
  selects with lightning_indexer (use_lightning_indexer) and attends to the top-k keys only, on
  the compressed latent (absorb_mla); the other implementations score every key with the
  model's own indexer, expand the latent into keys and values per head, and attend densely
  under a top-k mask.

* DeepSeek-V4-shaped (random weights, bf16): a sliding-window, a CSA and an HCA layer, 8 query
  heads of dim 512 over one shared key/value head, window 128, compression every 4 and 128
  tokens, top-512 indexer. Prefill of S tokens and generation of 32 tokens after a prompt of
  S / 2. "opmesh" runs the compressors, the indexer and the attention on opmesh's V4 operators;
  "eager" is the model's own path, which builds a dense bias over the window and the compressed
  entries. transformers has no SDPA path for this model.

* Serving (``--serve``): transformers' continuous batching (``generate_batch``) on the
  Llama-shaped model, "paged|opmesh" against "paged|sdpa": R concurrent requests with prompts of
  P / 2 to 3 P / 2 tokens, 32 new tokens each; tokens per second counts the new tokens.

    python benchmarks/bench_transformers.py [--seq 4096 8192] [--dsa-seq 8192] [--v4-seq 8192]
        [--models llama dsa deepseek_v4] [--skip-eager]
    python benchmarks/bench_transformers.py --serve [--requests 16 64] [--prompt 512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transformers  # noqa: E402
from common import interleaved, write_results  # noqa: E402

import opmesh.integrations.transformers as opmesh_hf  # noqa: E402

VOCAB = 1024


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=65536,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def deepseek_v32():
    config = transformers.DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
        kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        index_n_heads=8, index_head_dim=64, index_topk=2048, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, max_position_embeddings=65536,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def deepseek_v4():
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    config = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=512,
        o_lora_rank=512, o_groups=2, layer_types=kinds, sliding_window=128, index_topk=512,
        index_n_heads=8, index_head_dim=128, intermediate_size=2048, moe_intermediate_size=256,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        max_position_embeddings=65536,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def tokens(batch, length, seed=0):
    """Random token ids without id 0: generate() takes pad_token_id=0, and a prompt that held it
    would be read as a padded batch (an attention mask with holes)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator)


def prefill(model, ids):
    def run():
        with torch.no_grad():
            model(ids, use_cache=False)

    return run


def generate(model, ids, new_tokens):
    def run():
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)  # fmt: skip

    return run


def train_step(model, ids):
    def run():
        model.train()
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        model.eval()

    return run


def rates(model, run, impls, count, budget):
    """Tokens per second of run() under each attention implementation, the implementations timed
    in turn (three rounds, medians): one run's time moves by 10-30 % on a shared machine, and
    timing one implementation after the other would put that drift into the ratios."""

    def under(impl):
        def call():
            model.set_attn_implementation(impl)
            run()

        return call

    times = interleaved([under(impl) for impl in impls], budget_s=budget * len(impls),
                        min_repeats=1)  # fmt: skip
    return {impl: count / t for impl, t in zip(impls, times, strict=True)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seq",
        type=int,
        nargs="+",
        default=[4096, 8192],
        help="Llama prefill lengths (generation and training take half)",
    )
    parser.add_argument("--dsa-seq", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget", type=float, default=5.0)
    parser.add_argument("--skip-eager", action="store_true", help="leave the eager path out")
    parser.add_argument("--v4-seq", type=int, default=8192, help="DeepSeek-V4 prefill length")
    parser.add_argument("--models", nargs="+", default=["llama", "dsa", "deepseek_v4"],
                        choices=["llama", "dsa", "deepseek_v4"])  # fmt: skip
    parser.add_argument("--serve", action="store_true", help="continuous batching only")
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt", type=int, default=512, help="mean prompt length (--serve)")
    args = parser.parse_args()
    opmesh_hf.register()
    if args.serve:
        serve(args)
        return
    impls = ["opmesh", "sdpa"] + ([] if args.skip_eager else ["eager"])
    torch.manual_seed(0)
    rows = []
    if "llama" in args.models:
        rows += llama_rows(args, impls)
    if "dsa" in args.models:
        rows += dsa_rows(args, impls)
    if "deepseek_v4" in args.models:
        rows += v4_rows(args, [impl for impl in impls if impl != "sdpa"])

    columns = ["model", "step", "tokens", "opmesh tok/s", "sdpa tok/s", "eager tok/s",
               "opmesh / sdpa", "opmesh / eager"]  # fmt: skip
    notes = [
        "Tokens per second (higher is better): the prefill and the training step count the "
        "input tokens, generation the new tokens (after its prompt of `tokens`), batch 1, bf16.",
        "The model's own code runs around the attention, so the ratios are those of whole "
        "models, not of the attention alone.",
        "DeepSeek-V4 has no SDPA path in transformers (its sdpa columns are empty).",
    ]
    print(write_results("transformers", rows, columns, notes))


def llama_rows(args, impls):
    model = llama()
    cases = []
    for seq in args.seq:
        prompt = tokens(1, seq // 2)
        cases += [
            ("prefill", prefill(model, tokens(1, seq)), seq, seq),
            ("generate", generate(model, prompt, args.new_tokens), seq // 2, args.new_tokens),
            ("train step", train_step(model, prompt), seq // 2, seq // 2),
        ]
    rows = []
    for what, run, length, count in cases:
        rows.append(row("Llama 8/2 x128, 4 layers", what, length,
                        rates(model, run, impls, count, args.budget)))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def dsa_rows(args, impls):
    model = deepseek_v32()
    # Under "sdpa" and "eager" these modules run the model's own code.
    opmesh_hf.use_lightning_indexer(model)
    opmesh_hf.absorb_mla(model)
    run = prefill(model, tokens(1, args.dsa_seq))
    rows = [row("DeepSeek-V3.2 top-2048, 2 layers", "prefill", args.dsa_seq,
                rates(model, run, impls, args.dsa_seq, args.budget))]  # fmt: skip
    print(rows[-1], flush=True)
    return rows


def v4_rows(args, impls):
    model = deepseek_v4()
    name = "DeepSeek-V4 8x512, window 128, CSA 4 top-512, HCA 128, 3 layers"
    cases = [
        ("prefill", prefill(model, tokens(1, args.v4_seq)), args.v4_seq, args.v4_seq),
        ("generate", generate(model, tokens(1, args.v4_seq // 2), args.new_tokens),
         args.v4_seq // 2, args.new_tokens),
    ]  # fmt: skip
    rows = []
    for what, run, length, count in cases:
        rows.append(row(name, what, length, rates(model, run, impls, count, args.budget)))
        print(rows[-1], flush=True)
    return rows


def serve(args):
    """generate_batch's new tokens per second under paged|opmesh and paged|sdpa."""
    model = llama()
    impls = ["paged|opmesh", "paged|sdpa"]
    rows = []
    for count in args.requests:
        generator = torch.Generator().manual_seed(count)
        lengths = torch.randint(args.prompt // 2, 3 * args.prompt // 2 + 1, (count,),
                                generator=generator)  # fmt: skip
        inputs = [tokens(1, int(n), seed=i)[0].tolist() for i, n in enumerate(lengths)]
        page = 64
        blocks = sum(-(-(len(ids) + args.new_tokens) // page) for ids in inputs) + count
        config = transformers.ContinuousBatchingConfig(
            page_size=page, num_blocks=blocks, max_batch_tokens=2048
        )
        greedy = transformers.GenerationConfig(
            max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
        )

        def run(inputs=inputs, config=config, greedy=greedy):
            with torch.no_grad():
                model.generate_batch(
                    inputs, generation_config=greedy, continuous_batching_config=config,
                    progress_bar=False,
                )  # fmt: skip

        got = rates(model, run, impls, count * args.new_tokens, args.budget)
        rows.append({
            "requests": count, "prompt tokens": int(lengths.sum()), "new tokens": args.new_tokens,
            "opmesh tok/s": f"{got['paged|opmesh']:.1f}",
            "sdpa tok/s": f"{got['paged|sdpa']:.1f}",
            "opmesh / sdpa": f"{got['paged|opmesh'] / got['paged|sdpa']:.2f}x",
        })  # fmt: skip
        print(rows[-1], flush=True)
    columns = ["requests", "prompt tokens", "new tokens", "opmesh tok/s",
               "sdpa tok/s", "opmesh / sdpa"]  # fmt: skip
    notes = [
        "transformers' continuous batching (generate_batch) on the Llama-shaped model (bf16, "
        f"hidden 1024, 8/2 heads of dim 128, 4 layers): every request at once, prompts of "
        f"{args.prompt // 2} to {3 * args.prompt // 2} tokens, {args.new_tokens} new tokens "
        "each, greedy; pages of 64 tokens, at most 2048 tokens per batch.",
        "Tokens per second counts the new tokens over the whole run (prefills included); the "
        "two implementations timed in turn.",
    ]
    print(write_results("transformers_serve", rows, columns, notes))


def row(model, step, length, rates):
    out = {"model": model, "step": step, "tokens": length}
    for impl, rate in rates.items():
        out[f"{impl} tok/s"] = f"{rate:.1f}"
    if "sdpa" in rates:
        out["opmesh / sdpa"] = f"{rates['opmesh'] / rates['sdpa']:.2f}x"
    if "eager" in rates:
        out["opmesh / eager"] = f"{rates['opmesh'] / rates['eager']:.2f}x"
    return out


if __name__ == "__main__":
    main()
