"""Greedy decoding of a tiny DeepSeek-V4 model (transformers' ``deepseek_v4``, random weights)
with paged caches on opmesh's V4 operators, token for token equal to transformers' eager
generation.

Every layer keeps, per sequence, blocks of a paged cache (``[blocks, block_size, 1, D]``, block
tables one row per sequence):

* the raw key/value rows (``opmesh.kv_cache_write_``; the key is the value, so the value cache
  has width 0), read by ``opmesh.sparse_flash_mla`` through the window mask;
* CSA and HCA layers: the compressed entries, made by ``opmesh.compressor`` from the tokens of
  each step and the compressor's float32 state cache (the projections of the tokens of windows
  not yet closed, continuous mode), written one entry every ``compress_rate`` tokens and read by
  ``sparse_flash_mla`` (HCA: every entry a row has passed; CSA: the top-k picked by
  ``opmesh.lightning_indexer`` over the indexer's own paged compressed keys).

The model's own modules (projections, norms, rotary embeddings, experts, hyper-connections) run
around the operators; only the attention modules' forward is replaced.

    python examples/decode_v4.py [--prompt 21] [--new-tokens 32] [--batch 3]
"""

from __future__ import annotations

import argparse
import types

import torch
import transformers

import opmesh
from opmesh.integrations import deepseek_v4 as v4

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--prompt", type=int, default=21, help="prompt tokens per sequence")
parser.add_argument("--new-tokens", type=int, default=32)
parser.add_argument("--batch", type=int, default=3)
parser.add_argument("--block-size", type=int, default=8)
args = parser.parse_args()

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
config = transformers.DeepseekV4Config(
    vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_lora_rank=16, o_groups=2,
    layer_types=KINDS, sliding_window=8, index_topk=4, index_n_heads=8, index_head_dim=16,
    intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, max_position_embeddings=256,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
)  # fmt: skip
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.normal_()
TOTAL = args.prompt + args.new_tokens
BLOCKS = -(-TOTAL // args.block_size)  # blocks per sequence for the longest series


class PagedSeries:
    """One series of rows per sequence (raw keys, or one compressor's entries) in a paged cache
    whose sequence b owns blocks ``1 + b * BLOCKS ...`` (block 0 unused)."""

    def __init__(self, dim):
        self.cache = torch.zeros(1 + args.batch * BLOCKS, args.block_size, 1, dim)
        self.table = 1 + torch.arange(args.batch * BLOCKS).view(args.batch, BLOCKS)
        self.length = 0

    def append(self, rows):
        """Writes ``rows [B, n, D]`` after each sequence's rows."""
        count = rows.shape[1]
        positions = torch.arange(self.length, self.length + count)
        blocks = self.table[:, positions // args.block_size]
        slots = (blocks * args.block_size + positions % args.block_size).flatten()
        flat = rows.reshape(-1, 1, rows.shape[-1])
        opmesh.kv_cache_write_(flat, None, self.cache, None, slots)  # the key is the value
        self.length += count

    def read(self, prefix):
        """The call arguments reading every row so far (``prefix``: ``ori`` or ``cmp``)."""
        return {
            f"{prefix}_kv": self.cache,
            f"{prefix}_block_table": self.table,
            f"seqused_{prefix}_kv": [self.length] * args.batch,
        }


class Compressor:
    """A compressor module's state cache (continuous mode: a block per ``block_size`` positions
    of each sequence) and its paged entries."""

    def __init__(self, module):
        self.module = module
        width = 2 * module.kv_proj.weight.shape[0]  # [kv | score] per position
        self.state = torch.zeros(1 + args.batch * BLOCKS, args.block_size, width)
        self.table = 1 + torch.arange(args.batch * BLOCKS).view(args.batch, BLOCKS)
        self.entries = PagedSeries(module.head_dim)

    def step(self, hidden_states, start):
        new = v4.compress(self.module, hidden_states, start, self.state,
                          state_block_table=self.table, cache_mode=1)  # fmt: skip
        if new.shape[1]:
            self.entries.append(new)


def paged_forward(self, hidden_states, position_embeddings, position_ids, attention_mask,
                  past_key_values=None, **kwargs):  # fmt: skip
    """``DeepseekV4Attention.forward`` over this layer's paged caches (a batch without padding,
    every sequence at the same position)."""
    caches = self.paged
    length = hidden_states.shape[1]
    start = caches["raw"].length
    q, kv, q_residual = v4.project(self, hidden_states, position_embeddings)
    caches["raw"].append(kv[:, :, 0])
    call = dict(
        **caches["raw"].read("ori"), ori_mask_mode=4, ori_win_left=self.sliding_window - 1,
        ori_win_right=0, softmax_scale=self.scaling, sinks=self.sinks, layout_kv="PA_BBND",
    )  # fmt: skip
    if "compressor" in caches:
        compressor = caches["compressor"]
        ratio = compressor.module.compress_rate
        compressor.step(hidden_states, start)
        entries = compressor.entries
        if entries.length:
            call |= entries.read("cmp")
            residual = (start + length) % ratio
            call |= dict(cmp_ratio=ratio, cmp_mask_mode=3, cmp_residual_kv=[residual] * args.batch)
            if "indexer" in caches:
                indexer = caches["indexer"]
                indexer.step(hidden_states, start)
                index_q, weights = v4.index_queries(indexer.module, hidden_states, q_residual,
                                                    position_ids)  # fmt: skip
                keys = indexer.entries
                picked, _ = opmesh.lightning_indexer(
                    index_q, keys.cache, weights, actual_seq_lengths_key=[keys.length] * args.batch,
                    block_table=keys.table, layout_key="PA_BSND",
                    sparse_count=min(indexer.module.index_topk, keys.length), cmp_ratio=ratio,
                    cmp_residual_key=[residual] * args.batch,
                )  # fmt: skip
                call["cmp_sparse_indices"] = picked
        elif "indexer" in caches:
            caches["indexer"].step(hidden_states, start)
    out, _ = opmesh.sparse_flash_mla(q, **call)
    return v4.output(self, out, position_embeddings), None


def install_paged_caches():
    for layer in model.model.layers:
        attention = layer.self_attn
        caches = {"raw": PagedSeries(attention.head_dim)}
        if attention.compressor is not None:
            caches["compressor"] = Compressor(attention.compressor)
            indexer = getattr(attention.compressor, "indexer", None)
            if indexer is not None:
                caches["indexer"] = Compressor(indexer)
        attention.paged = caches
        attention.forward = types.MethodType(paged_forward, attention)


@torch.no_grad()
def generate_paged(prompt):
    install_paged_caches()
    model.set_attn_implementation("eager")  # the masks it builds are not read
    tokens, position = prompt, 0
    out = []
    for _ in range(args.new_tokens):
        positions = torch.arange(position, position + tokens.shape[1]).unsqueeze(0)
        logits = model(tokens, position_ids=positions, use_cache=False).logits
        position += tokens.shape[1]
        tokens = logits[:, -1:].argmax(-1)
        out.append(tokens)
    return torch.cat(out, 1)


prompt = torch.randint(1, config.vocab_size, (args.batch, args.prompt),
                       generator=torch.Generator().manual_seed(1))  # fmt: skip
model.set_attn_implementation("eager")
model.generation_config.eos_token_id = None  # random weights: no end of sequence, all tokens
with torch.no_grad():
    eager = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=0)[:, args.prompt :]  # fmt: skip
paged = generate_paged(prompt)
same = torch.equal(paged, eager)
verdict = "equal to" if same else "DIFFERENT from"
print(f"{args.new_tokens} greedy tokens x {args.batch} sequences with paged raw, compressed and "
      f"indexer caches: {verdict} transformers' eager generation")  # fmt: skip
if not same:
    raise SystemExit(1)
