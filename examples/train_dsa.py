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

``--model v4`` trains DeepSeek-V4's compressed sparse attention instead: one shared key/value
head attends (``opmesh.sparse_flash_mla``, with sinks) to a sliding window of 16 tokens and to
compressed entries, one per 4 tokens made by ``opmesh.compressor`` from the hidden states (two
overlapping series). The dense stages attend to every entry a token has passed; the indexer
scores entries through its own compressor and learns with the KL losses over compressed keys
(``cmp_ratio``); the sparse stage attends to the window and the indexer's top-k entries. The
recall is then over entries.

    python examples/train_dsa.py [--model v32|v4] [--steps 120] [--seq 128] [--top-k 16]
        [--plot dsa.png]

With ``--model v4 --steps 120`` (``make demo``) the indexer's top-4 recall of the attention
mass over entries rises from about 0.3 to about 0.75 in the warm-up, and the sparse model ends
within 0.2 nats of the dense run.
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
parser.add_argument("--top-k", type=int, default=None, help="16 keys (v32), 4 entries (v4)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--plot", default=None, help="write the curves to this PNG file")
parser.add_argument("--model", choices=["v32", "v4"], default="v32",
                    help="DeepSeek-V3.2's sparse attention or V4's compressed one")  # fmt: skip
args = parser.parse_args()
if args.top_k is None:
    args.top_k = 4 if args.model == "v4" else 16

torch.manual_seed(args.seed)
KEYS, VALUES, MODEL = 24, 8, 64
HEADS, HEAD_DIM = 4, 16
INDEX_HEADS, INDEX_DIM = 4, 16
SCALE = HEAD_DIM**-0.5


def batch(size=args.batch):
    """Hidden states [B, S, MODEL] and the answers [B, S] (-1 where there is nothing to
    answer: shown pairs, and asked keys not shown before)."""
    # V4: a key and whether it is asked hold for runs of 4 tokens (one compressed entry's).
    span = 4 if args.model == "v4" else 1
    runs = -(-args.seq // span)
    keys = torch.randint(0, KEYS, (size, runs)).repeat_interleave(span, 1)[:, : args.seq]
    table = torch.randint(0, VALUES, (size, KEYS))
    values = table.gather(1, keys)
    asked = (torch.rand(size, runs) < 0.5).repeat_interleave(span, 1)[:, : args.seq]
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


RATIO, WINDOW = 4, 16  # DeepSeek-V4: tokens per compressed entry, the raw keys' window


def v4_kl(x):
    """The compressed-key arguments of the indexer and the KL losses for hidden states x."""
    return dict(cmp_ratio=RATIO, cmp_residual_key=[x.shape[1] % RATIO] * x.shape[0])


def compressed(x, wkv, wgate, ape):
    """The compressed entries [B, S // RATIO, 1, dim] of hidden states x (two overlapping
    series)."""
    return opmesh.compressor(x, wkv, wgate, None, ape, RATIO, coff=2)[
        :, : x.shape[1] // RATIO, None
    ]


class V4Model(Model):
    """DeepSeek-V4's attention: a shared key/value head over the window and the compressed
    entries, with sinks."""

    def __init__(self):
        super().__init__()
        del self.v
        self.wkv = torch.nn.Parameter(torch.randn(2 * HEAD_DIM, MODEL) * MODEL**-0.5)
        self.wgate = torch.nn.Parameter(torch.randn(2 * HEAD_DIM, MODEL) * MODEL**-0.5)
        self.ape = torch.nn.Parameter(torch.zeros(RATIO, 2 * HEAD_DIM))
        self.sinks = torch.nn.Parameter(torch.zeros(HEADS))

    def qkv(self, x):
        """Queries, the raw keys (the values too) and the compressed entries."""
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM)
        return q, self.k(x).view(b, s, 1, HEAD_DIM), compressed(x, self.wkv, self.wgate, self.ape)

    def attend(self, q, kv, entries, picked=None):
        out, _ = opmesh.sparse_flash_mla(
            q, ori_kv=kv, cmp_kv=entries, cmp_sparse_indices=picked, sinks=self.sinks,
            softmax_scale=SCALE, cmp_ratio=RATIO, ori_win_left=WINDOW - 1, ori_win_right=0,
        )  # fmt: skip
        return out


def entry_statistics(q, entries, picked=None):
    """The main attention's statistics over the compressed entries alone (every entry a token
    has passed, or the picked ones): the KL losses' target over the keys they score."""
    _, lse = opmesh.sparse_flash_mla(
        q, cmp_kv=entries, cmp_sparse_indices=picked, softmax_scale=SCALE, cmp_ratio=RATIO,
        return_softmax_lse=True,
    )  # fmt: skip
    return lse, torch.ones_like(lse)


class V4Indexer(Indexer):
    """The indexer over compressed keys: its queries and weights per token, its keys from its
    own compressor."""

    def __init__(self):
        super().__init__()
        del self.key
        self.wkv = torch.nn.Parameter(torch.randn(2 * INDEX_DIM, MODEL) * MODEL**-0.5)
        self.wgate = torch.nn.Parameter(torch.randn(2 * INDEX_DIM, MODEL) * MODEL**-0.5)
        self.ape = torch.nn.Parameter(torch.zeros(RATIO, 2 * INDEX_DIM))

    def forward(self, x):
        b, s, _ = x.shape
        query_index = self.query(x).view(b, s, INDEX_HEADS, INDEX_DIM)
        weights = self.weights(x) * (INDEX_HEADS * INDEX_DIM) ** -0.5
        return query_index, compressed(x, self.wkv, self.wgate, self.ape), weights


def task_loss(logits, answers):
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), answers.flatten(), ignore_index=-1
    )


def dense_step(model, tokens):
    """Dense attention: the logits and the main attention's statistics [B, 1, S, HEADS] (V4:
    every entry a token has passed, the statistics over the entries)."""
    if args.model == "v4":
        q, kv, entries = model.qkv(model.hidden(tokens))
        stats = entry_statistics(q.detach(), entries.detach())
        return model.logits(model.attend(q, kv, entries)), (q, entries, *stats)
    q, k, v = model.qkv(model.hidden(tokens))
    out, lse = opmesh.flash_attn(q, k, v, softmax_scale=SCALE, mask_mode=3, return_softmax_lse=True)
    softmax_max = lse.detach().transpose(1, 2).unsqueeze(1).contiguous()
    return model.logits(out), (q, k, softmax_max, torch.ones_like(softmax_max))


def sparse_step(model, indexer, tokens):
    """Sparse attention over the indexer's top-k, and the indexer's sparse KL loss."""
    x = model.hidden(tokens)
    if args.model == "v4":
        q, kv, entries = model.qkv(x)
        query_index, key_index, weights = indexer(x.detach())
        top, _ = opmesh.lightning_indexer(
            query_index, key_index, weights, sparse_count=args.top_k, **v4_kl(x)
        )
        q_, entries_ = q.detach(), entries.detach()
        smax, ssum = entry_statistics(q_, entries_, top)
        kl = opmesh.sparse_indexer_kl_loss(
            query_index, key_index, weights, q_, entries_, top, smax, ssum, SCALE, **v4_kl(x)
        )
        return model.logits(model.attend(q, kv, entries, top)), kl
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
    q, k, entries = model.qkv(x)
    if args.model == "v4":  # the keys recalled are the compressed entries
        k = entries
    s, t = x.shape[1], k.shape[1]
    position = torch.arange(s)[:, None]
    if args.model == "v4":  # entry j once its last token has passed
        seen = (torch.arange(t)[None] + 1) * RATIO <= position + 1
        first = (args.top_k + 1) * RATIO - 1  # rows that see more than k entries
        kl = v4_kl(x)
    else:
        seen, first, kl = torch.arange(t)[None] <= position, args.top_k, {}
    logits = torch.einsum("bshd,btd->bhst", q, k[:, :, 0]) * SCALE
    target = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1).mean(1)
    top, _ = opmesh.lightning_indexer(*indexer(x), sparse_count=args.top_k, **kl)
    top = top[:, first:, 0].long()
    return target[:, first:].gather(-1, top).sum(-1).mean().item()


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
model = V4Model() if args.model == "v4" else Model()
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
indexer = V4Indexer() if args.model == "v4" else Indexer()
index_optimizer = torch.optim.Adam(indexer.parameters(), lr=1e-2)
recall_before = top_k_recall(model, indexer, EVALUATION[0])
print(f"top-{args.top_k} recall before the warm-up: {recall_before:.3f}")
recalls.append((args.steps, recall_before))
for step in range(args.steps):
    tokens, _ = batch()
    with torch.no_grad():
        x = model.hidden(tokens)
        _, (q, k, softmax_max, softmax_sum) = dense_step(model, tokens)
    kl = opmesh.indexer_kl_loss(
        *indexer(x),
        q,
        k,
        softmax_max,
        softmax_sum,
        SCALE,
        **(v4_kl(x) if args.model == "v4" else {}),
    )
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
of = f"{args.seq // RATIO} entries" if args.model == "v4" else f"{args.seq}"
print(f"evaluation task loss: sparse (top-{args.top_k} of {of}) {sparse_eval:.3f}, "
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
