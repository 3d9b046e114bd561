"""Trains a small causal attention model with context parallelism on CPU.

Every rank holds a slice of each sequence's tokens (head-tail order, so causal work is even),
computes its projections locally, and runs flash_attn on DTensors sharded along the sequence:
keys and values are all-gathered inside the op and their gradients reduce-scattered back.
Parameter gradients are summed over the ranks, so every rank takes the same optimizer step as
one process training on whole sequences would.

The task: each sequence is random tokens, and every position in its second half must name the
sequence's first token. Only attention back to the start of the sequence, which lives on
another rank for half of those positions, can learn it.

Run: ``torchrun --nproc-per-node 2 examples/train_context_parallel.py --steps 100``; on several
nodes, the same script under torchrun's rendezvous (docs/distributed.md).
With ``--check`` rank 0 also trains the same model in one process on whole sequences and reports
the largest loss difference between the two runs.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import opmesh


class TinyAttentionModel(torch.nn.Module):
    def __init__(self, vocab, dim, heads, kv_heads, seq):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Parameter(torch.randn(seq, dim))
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, positions, attention):
        """tokens, positions: [B, L] (this rank's slice); attention(q, k, v) -> out."""
        x = self.embed(tokens) + self.position[positions]
        b, length, _ = x.shape
        q = self.q(x).view(b, length, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, length, 2, self.kv_heads, self.head_dim).unbind(2)
        out = attention(q, k, v).reshape(b, length, -1)
        return self.head(self.o(out))


def batch(step, batch_size, length, vocab):
    """Random tokens; the target at every position is the sequence's first token."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch_size, length), generator=g)
    return tokens, tokens[:, :1].expand(-1, length)


def loss_sum(model, tokens, targets, positions, attention):
    """Summed cross-entropy over the second half of each sequence, for the tokens given."""
    logits = model(tokens, positions, attention)
    weight = (positions >= model.position.shape[0] // 2).float()
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (per_token * weight.flatten()).sum()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--check", action="store_true", help="compare with one process")
    parser.add_argument(
        "--context-parallel",
        choices=("all_gather", "ulysses"),
        default="all_gather",
        help="how keys and values reach the ranks: all-gathered, or exchanged all-to-all "
        "into head-sharded full sequences (Ulysses)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = opmesh.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    length = args.seq
    if length % (2 * world):
        raise SystemExit(f"--seq: {length} must be a multiple of 2 * ranks = {2 * world}")
    vocab, dim = 32, 64
    torch.manual_seed(0)
    model = TinyAttentionModel(vocab, dim, heads=4, kv_heads=2, seq=length)
    reference = copy.deepcopy(model) if args.check and rank == 0 else None
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2) if reference else None

    S1 = [opmesh.Shard(1)]
    positions = opmesh.to_head_tail(torch.arange(length).expand(args.batch, -1), 1, world)
    mine = slice(*[i * length // world for i in (rank, rank + 1)])

    def cp_attention(q, k, v):
        dq, dk, dv = (_to_dtensor(x, mesh, S1, length) for x in (q, k, v))
        with opmesh.head_tail_cp():
            out, _ = opmesh.flash_attn(
                dq, dk, dv, mask_mode=3, context_parallel=args.context_parallel
            )
        return out.to_local()

    def whole_attention(q, k, v):
        return opmesh.flash_attn(q, k, v, mask_mode=3)[0]

    first = last = None
    worst = 0.0
    for step in range(args.steps):
        tokens, targets = batch(step, args.batch, length, vocab)
        local = [opmesh.to_head_tail(x, 1, world)[:, mine] for x in (tokens, targets)]
        loss = loss_sum(model, *local, positions[:, mine], cp_attention)
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # every rank's partial gradient, summed
            dist.all_reduce(p.grad)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        per_token = total.item() / (args.batch * length // 2)
        first = per_token if first is None else first
        last = per_token
        if reference is not None:
            ref_loss = loss_sum(
                reference, tokens, targets, torch.arange(length).expand(args.batch, -1),
                whole_attention,
            )  # fmt: skip
            ref_optimizer.zero_grad()
            ref_loss.backward()
            ref_optimizer.step()
            worst = max(worst, abs(ref_loss.item() / (args.batch * length // 2) - per_token))
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss per token {per_token:.3f}", flush=True)
    if rank == 0:
        print(
            f"loss {first:.3f} -> {last:.3f} on {world} ranks (context parallel, "
            f"{args.context_parallel})"
        )
        if reference is not None:
            print(f"largest loss difference from one process: {worst:.2e}")
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()


def _to_dtensor(x, mesh, placements, length):
    """A rank's slice of the sequence as a DTensor (differentiable)."""
    from torch.distributed.tensor import DTensor

    shape = torch.Size((x.shape[0], length, *x.shape[2:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(x, mesh, placements, run_check=False, shape=shape, stride=stride)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # DTensor's caches hold the device mesh, and with it the gloo process group's worker
    # threads, until the interpreter shuts down. A worker still letting go of its last
    # collective's tensors then needs the GIL and aborts the process ("terminate called
    # without an active exception") after a run that went well. The group is destroyed and
    # the output flushed: leave without the interpreter's finalisation.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
