"""Dense warm-up of a lightning indexer on CPU: a small attention layer whose indexer learns,
through opmesh's fused KL loss, to point at the keys its own dense attention attends to.

The data is synthetic: sequences of tokens from a small vocabulary, embedded with noise. The
main attention (frozen projections) attends mostly to earlier occurrences of the same token;
the indexer (query_index, key_index and weights projections of the same hidden states) starts
random. Each step computes the main attention with opmesh.flash_attn and its log-sum-exp, then
opmesh.indexer_kl_loss, and updates only the indexer. The script prints the loss and the
indexer's top-k recall: the share of the main attention's mass that falls on the k keys the
indexer ranks highest.

    python examples/train_indexer_warmup.py [--steps 150] [--seq 256]
"""

from __future__ import annotations

import argparse

import torch

import opmesh

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--seq", type=int, default=256)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--top-k", type=int, default=16)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
VOCAB, MODEL = 32, 64
HEADS, HEAD_DIM = 4, 32  # main attention: 4 query heads over 1 key head
INDEX_HEADS, INDEX_DIM = 4, 16
embedding = torch.randn(VOCAB, MODEL)
w_q = torch.randn(MODEL, HEADS * HEAD_DIM) * MODEL**-0.5 * 2.0
w_k = torch.randn(MODEL, HEAD_DIM) * MODEL**-0.5 * 2.0
scale = HEAD_DIM**-0.5


class Indexer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.query = torch.nn.Linear(MODEL, INDEX_HEADS * INDEX_DIM, bias=False)
        self.key = torch.nn.Linear(MODEL, INDEX_DIM, bias=False)
        self.weights = torch.nn.Linear(MODEL, INDEX_HEADS, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        query_index = self.query(x).view(b, s, INDEX_HEADS, INDEX_DIM)
        key_index = self.key(x).view(b, s, 1, INDEX_DIM)
        weights = self.weights(x) * (INDEX_HEADS * INDEX_DIM) ** -0.5
        return query_index, key_index, weights


def batch():
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq))
    return embedding[tokens] + 0.3 * torch.randn(args.batch, args.seq, MODEL)


def main_attention(x):
    """The main attention's inputs and its statistics as [B, N2, S1, G]."""
    b, s, _ = x.shape
    q = (x @ w_q).view(b, s, HEADS, HEAD_DIM)
    k = (x @ w_k).view(b, s, 1, HEAD_DIM)
    _, lse = opmesh.flash_attn(q, k, k, softmax_scale=scale, mask_mode=3, return_softmax_lse=True)
    softmax_max = lse.transpose(1, 2).unsqueeze(1).contiguous()  # [B, 1, S, HEADS]
    return q, k, softmax_max, torch.ones_like(softmax_max)


@torch.no_grad()
def top_k_recall(x, indexer):
    """Share of the main attention's (head-averaged) mass on the indexer's top-k keys."""
    q, k, _, _ = main_attention(x)
    s = x.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    logits = torch.einsum("bshd,btd->bhst", q, k[:, :, 0]) * scale
    target = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).mean(1)
    query_index, key_index, weights = indexer(x)
    dots = torch.einsum("bshd,btd->bsht", query_index, key_index[:, :, 0]).relu()
    scores = (dots * weights[..., None]).sum(2).masked_fill(~causal, float("-inf"))
    top = scores.topk(args.top_k, dim=-1).indices
    return target.gather(-1, top).sum(-1)[:, args.top_k :].mean().item()


indexer = Indexer()
optimizer = torch.optim.Adam(indexer.parameters(), lr=1e-2)
evaluation = batch()
print(f"top-{args.top_k} recall before training: {top_k_recall(evaluation, indexer):.3f}")
first = None
for step in range(1, args.steps + 1):
    x = batch()
    q, k, softmax_max, softmax_sum = main_attention(x)
    query_index, key_index, weights = indexer(x)
    loss = opmesh.indexer_kl_loss(
        query_index, key_index, weights, q, k, softmax_max, softmax_sum, scale
    )
    per_token = loss.item() / (args.batch * args.seq)
    first = per_token if first is None else first
    optimizer.zero_grad()
    loss.sum().backward()
    optimizer.step()
    if step == 1 or step % max(1, args.steps // 5) == 0 or step == args.steps:
        recall = top_k_recall(evaluation, indexer)
        print(f"step {step:4d}  KL per token {per_token:.4f}  top-{args.top_k} recall {recall:.3f}")
print(f"KL per token: {first:.4f} -> {per_token:.4f}")
