"""DeepSeek sparse attention's two training stages on CPU, on a small attention model.

The task is associative recall: each sequence draws a random map from keys to values; a token
either shows a pair (key and value, wrong one time in five) or asks for a key (its value
hidden), and the model must answer with the value shown earlier for that key. One causal
attention layer (4 query heads over 1 key head) reads the answer from the tokens that showed
the same key.

1. ``pretrain``: the model with dense attention (``opmesh.flash_attn``) learns the task.
2. ``warm-up``: the model is frozen; a lightning indexer (query_index, key_index, weights
   projections of the same hidden states) learns the main attention's distribution through the
   dense KL loss (``opmesh.indexer_kl_loss``).
3. ``sparse``: the main attention runs through ``opmesh.sparse_flash_attention`` over the
   indexer's top-k (``opmesh.lightning_indexer``); the model trains on the task's loss, the
   indexer on the sparse KL loss (``opmesh.sparse_indexer_kl_loss``) with its inputs detached,
   so each learns only from its own loss. A dense run continues from the same state for
   comparison.

The script prints the losses and the indexer's top-k recall (the share of the main attention's
mass on the k keys the indexer ranks highest), and with ``--plot FILE`` draws them to a PNG.
With the defaults the sparse model's task loss ends within 0.1 nats of the dense run's.

    python examples/train_dsa.py [--steps 120] [--seq 128] [--top-k 16] [--plot dsa.png]
"""

from __future__ import annotations

import argparse
import copy

import torch

import opmesh

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=120, help="steps of each stage")
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--top-k", type=int, default=16)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--plot", default=None, help="write the curves to this PNG file")
args = parser.parse_args()

torch.manual_seed(args.seed)
KEYS, VALUES, MODEL = 24, 8, 64
HEADS, HEAD_DIM = 4, 16
INDEX_HEADS, INDEX_DIM = 4, 16
SCALE = HEAD_DIM**-0.5


def batch(size=args.batch):
    """Hidden states [B, S, MODEL] and the answers [B, S] (-1 where there is nothing to
    answer: shown pairs, and asked keys not shown before)."""
    keys = torch.randint(0, KEYS, (size, args.seq))
    table = torch.randint(0, VALUES, (size, KEYS))
    values = table.gather(1, keys)
    asked = torch.rand(size, args.seq) < 0.5
    shown = (~asked).long()
    # A shown value is wrong one time in five: an answer should weigh every earlier showing.
    noisy = torch.rand(size, args.seq) < 0.2
    values_shown = torch.where(noisy, torch.randint(0, VALUES, (size, args.seq)), values)
    seen = torch.zeros(size, args.seq, KEYS, dtype=torch.long)
    seen.scatter_(2, keys[..., None], shown[..., None])
    seen = seen.cumsum(1).gather(2, keys[..., None])[..., 0] - shown  # shown before t
    answers = torch.where(asked & (seen > 0), values, -1)
    return (keys, torch.where(asked, VALUES, values_shown)), answers


class Model(torch.nn.Module):
    """Embeddings, one causal attention layer and a read-out."""

    def __init__(self):
        super().__init__()
        self.key_embedding = torch.nn.Embedding(KEYS, MODEL)
        self.value_embedding = torch.nn.Embedding(VALUES + 1, MODEL)  # VALUES: hidden
        self.q = torch.nn.Linear(MODEL, HEADS * HEAD_DIM, bias=False)
        self.k = torch.nn.Linear(MODEL, HEAD_DIM, bias=False)
        self.v = torch.nn.Linear(MODEL, HEAD_DIM, bias=False)
        self.out = torch.nn.Linear(HEADS * HEAD_DIM, VALUES)

    def hidden(self, tokens):
        keys, values = tokens
        return self.key_embedding(keys) + self.value_embedding(values)

    def qkv(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM)
        return q, self.k(x).view(b, s, 1, HEAD_DIM), self.v(x).view(b, s, 1, HEAD_DIM)

    def logits(self, attention_out):
        return self.out(attention_out.flatten(2))


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


def task_loss(logits, answers):
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), answers.flatten(), ignore_index=-1
    )


def dense_step(model, tokens):
    """Dense attention: the logits and the main attention's statistics [B, 1, S, HEADS]."""
    q, k, v = model.qkv(model.hidden(tokens))
    out, lse = opmesh.flash_attn(q, k, v, softmax_scale=SCALE, mask_mode=3, return_softmax_lse=True)
    softmax_max = lse.detach().transpose(1, 2).unsqueeze(1).contiguous()
    return model.logits(out), (q, k, softmax_max, torch.ones_like(softmax_max))


def sparse_step(model, indexer, tokens):
    """Sparse attention over the indexer's top-k, and the indexer's sparse KL loss."""
    x = model.hidden(tokens)
    q, k, v = model.qkv(x)
    query_index, key_index, weights = indexer(x.detach())
    top, _ = opmesh.lightning_indexer(query_index, key_index, weights, sparse_count=args.top_k)
    out, smax, ssum = opmesh.sparse_flash_attention(q, k, v, top, SCALE, return_softmax_lse=True)
    kl = opmesh.sparse_indexer_kl_loss(
        query_index, key_index, weights, q.detach(), k.detach(), top, smax, ssum, SCALE
    )
    return model.logits(out), kl


@torch.no_grad()
def top_k_recall(model, indexer, tokens):
    """The share of the main attention's (head-averaged) mass on the indexer's top-k keys, over
    the rows that see more than k keys."""
    x = model.hidden(tokens)
    q, k, _ = model.qkv(x)
    s = x.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    logits = torch.einsum("bshd,btd->bhst", q, k[:, :, 0]) * SCALE
    target = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).mean(1)
    top, _ = opmesh.lightning_indexer(*indexer(x), sparse_count=args.top_k)
    top = top[:, args.top_k :, 0].long()  # rows past the first k see more than k keys
    return target[:, args.top_k :].gather(-1, top).sum(-1).mean().item()


@torch.no_grad()
def evaluate(model, indexer=None):
    tokens, answers = EVALUATION
    if indexer is None:
        logits, _ = dense_step(model, tokens)
    else:
        logits, _ = sparse_step(model, indexer, tokens)
    return task_loss(logits, answers).item()


EVALUATION = batch(32)
history = {"pretrain": [], "warm-up KL": [], "sparse": [], "sparse KL": [], "dense": []}
recalls = []  # (global step, recall)

# 1. Pretraining with dense attention.
model = Model()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(args.steps):
    tokens, answers = batch()
    logits, _ = dense_step(model, tokens)
    loss = task_loss(logits, answers)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    history["pretrain"].append(loss.item())
print(f"pretrain: task loss {history['pretrain'][0]:.3f} -> {history['pretrain'][-1]:.3f}, "
      f"evaluation {evaluate(model):.3f}")  # fmt: skip

# 2. Indexer warm-up on the dense KL loss, the model frozen.
indexer = Indexer()
index_optimizer = torch.optim.Adam(indexer.parameters(), lr=1e-2)
recall_before = top_k_recall(model, indexer, EVALUATION[0])
print(f"top-{args.top_k} recall before the warm-up: {recall_before:.3f}")
recalls.append((args.steps, recall_before))
for step in range(args.steps):
    tokens, _ = batch()
    with torch.no_grad():
        x = model.hidden(tokens)
        _, (q, k, softmax_max, softmax_sum) = dense_step(model, tokens)
    kl = opmesh.indexer_kl_loss(*indexer(x), q, k, softmax_max, softmax_sum, SCALE)
    per_token = kl.item() / (args.batch * args.seq)
    index_optimizer.zero_grad()
    kl.sum().backward()
    index_optimizer.step()
    history["warm-up KL"].append(per_token)
    if (step + 1) % max(1, args.steps // 4) == 0:
        recalls.append((args.steps + step + 1, top_k_recall(model, indexer, EVALUATION[0])))
warm = history["warm-up KL"]
print(f"warm-up: KL per token {warm[0]:.4f} -> {warm[-1]:.4f}, "
      f"top-{args.top_k} recall {recalls[-1][1]:.3f}")  # fmt: skip

# 3. The sparse stage, and a dense run from the same state.
dense_model = copy.deepcopy(model)
dense_optimizer = torch.optim.Adam(dense_model.parameters(), lr=3e-3)
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
for step in range(args.steps):
    tokens, answers = batch()
    logits, kl = sparse_step(model, indexer, tokens)
    loss = task_loss(logits, answers)
    optimizer.zero_grad()
    index_optimizer.zero_grad()
    (loss + kl.sum() / (args.batch * args.seq)).backward()
    optimizer.step()
    index_optimizer.step()
    history["sparse"].append(loss.item())
    history["sparse KL"].append(kl.item() / (args.batch * args.seq))
    logits, _ = dense_step(dense_model, tokens)
    dense_loss = task_loss(logits, answers)
    dense_optimizer.zero_grad()
    dense_loss.backward()
    dense_optimizer.step()
    history["dense"].append(dense_loss.item())
    if (step + 1) % max(1, args.steps // 4) == 0:
        recalls.append((2 * args.steps + step + 1, top_k_recall(model, indexer, EVALUATION[0])))
sparse_eval, dense_eval = evaluate(model, indexer), evaluate(dense_model)
print(f"sparse stage: task loss {history['sparse'][0]:.3f} -> {history['sparse'][-1]:.3f}, "
      f"KL per token {history['sparse KL'][0]:.4f} -> {history['sparse KL'][-1]:.4f}, "
      f"top-{args.top_k} recall {recalls[-1][1]:.3f}")  # fmt: skip
print(f"evaluation task loss: sparse (top-{args.top_k} of {args.seq}) {sparse_eval:.3f}, "
      f"dense {dense_eval:.3f}")  # fmt: skip

if args.plot:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_kl, ax_recall) = plt.subplots(1, 3, figsize=(15, 4))
    n = args.steps
    ax_loss.plot(range(n), history["pretrain"], label="pretrain (dense)")
    ax_loss.plot(range(2 * n, 3 * n), history["sparse"], label="sparse stage")
    ax_loss.plot(range(2 * n, 3 * n), history["dense"], label="dense run", alpha=0.6)
    ax_loss.set(title="task loss", xlabel="step")
    ax_kl.plot(range(n, 2 * n), history["warm-up KL"], label="warm-up (dense KL)")
    ax_kl.plot(range(2 * n, 3 * n), history["sparse KL"], label="sparse stage (sparse KL)")
    ax_kl.set(title="indexer KL per token", xlabel="step", yscale="log")
    ax_recall.plot(*zip(*recalls, strict=True), marker="o")
    ax_recall.set(
        title=f"top-{args.top_k} recall of the attention mass", xlabel="step", ylim=(0, 1)
    )
    for ax in (ax_loss, ax_kl):
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=80)
    print(f"wrote {args.plot}")
