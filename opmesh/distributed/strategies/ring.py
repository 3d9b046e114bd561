"""Ring context parallel: keys and values travel around the context-parallel group while each
rank keeps its query rows.

Rank r of a group of n holds query rows, keys and values of chunk r of the sequence. In step s it
holds the keys and values of chunk (r - s) mod n, attends its queries to them (every key when the
chunk comes earlier in the sequence, causally when it is its own, not at all when it comes later
under a causal mask) and merges the partial result into its running (out, lse) with
merge_attn_states; meanwhile the chunk it holds is sent on to rank r + 1 and the next one received
from rank r - 1, so the transfer overlaps the computation. Sinks join the partial of the rank's own
chunk only.

Backward walks the ring again: each chunk travels with its dk and dv accumulators, every rank adds
what its query rows contribute (flash_attn_backward with the final out and lse, which makes each
block's part exact), and after n steps every chunk is home with its complete gradients; dq stays
with its rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import platform as _platform
from .data_parallel import shard_sizes
from .heads import head_slice


class RingGroup:
    """The context-parallel group of a mesh axis: this rank's position, the global ranks of its
    neighbours, and every position's chunk length (uneven sizes included)."""

    def __init__(self, group, position, size, lengths):
        self.group, self.position, self.size, self.lengths = group, position, size, lengths
        self.next = dist.get_global_rank(group, (position + 1) % size)
        self.prev = dist.get_global_rank(group, (position - 1) % size)


def _shift(tensors, ring, incoming_length, s_dims):
    """Sends `tensors` to the next rank and receives the previous rank's (whose sequence dim
    holds `incoming_length` rows); returns (requests, received). Empty tensors are not sent:
    both sides know every chunk's length."""
    ops, received = [], []
    for t, dim in zip(tensors, s_dims, strict=True):
        shape = list(t.shape)
        shape[dim] = incoming_length
        buffer = torch.empty(shape, dtype=t.dtype, device=t.device)
        received.append(buffer)
        if t.numel() > 0:
            ops.append(dist.P2POp(dist.isend, t.contiguous(), ring.next, ring.group))
        if buffer.numel() > 0:
            ops.append(dist.P2POp(dist.irecv, buffer, ring.prev, ring.group))
    requests = dist.batch_isend_irecv(ops) if ops else []
    return requests, received


def _block_mask(ring, step, causal):
    """mask_mode for the chunk held at `step` against this rank's queries, or None to skip."""
    source = (ring.position - step) % ring.size
    if not causal or source < ring.position:
        return 0
    if source == ring.position:
        return 3
    return None


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, ring, causal, options):
        s_dim = 1 if options["layout_kv"] == "BSND" else 2
        out_s_dim = 1 if options["layout_out"] == "BSND" else 2
        batch, heads = q.shape[0], q.shape[2 if s_dim == 1 else 1]
        rows = q.shape[s_dim]
        dv = v.shape[-1]
        out_shape = [batch, 0, 0, dv]
        out_shape[out_s_dim], out_shape[3 - out_s_dim] = rows, heads
        out = torch.zeros(out_shape, dtype=torch.float32, device=q.device)
        lse = torch.full((batch, heads, rows), float("inf"), device=q.device)
        current = (k, v)
        for step in range(ring.size):
            if step < ring.size - 1:
                incoming = ring.lengths[(ring.position - step - 1) % ring.size]
                requests, received = _shift(current, ring, incoming, (s_dim, s_dim))
            mode = _block_mask(ring, step, causal)
            if mode is not None and current[0].shape[s_dim] > 0:
                part_out, part_lse = torch.ops.opmesh.flash_attn(
                    q,
                    *current,
                    sinks=sinks if step == 0 else None,
                    mask_mode=mode,
                    return_softmax_lse=True,
                    **options,
                )
                out, lse = torch.ops.opmesh.merge_attn_states(
                    out, lse, part_out.float(), part_lse, layout=options["layout_out"]
                )
            elif step == 0 and sinks is not None:
                raise AssertionError("a rank's own chunk is never skipped")
            if step < ring.size - 1:
                for request in requests:
                    request.wait()
                current = tuple(received)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks if sinks is not None else torch.empty(0))
        ctx.ring, ctx.causal, ctx.options, ctx.has_sinks = ring, causal, options, sinks is not None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ring, options = ctx.ring, ctx.options
        sinks = sinks if ctx.has_sinks else None
        s_dim = 1 if options["layout_kv"] == "BSND" else 2
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dsinks = None
        # Each chunk travels with its gradient accumulators (float32).
        current = (
            k,
            v,
            torch.zeros(k.shape, device=k.device),
            torch.zeros(v.shape, device=v.device),
        )
        for step in range(ring.size):
            mode = _block_mask(ring, step, ctx.causal)
            if mode is not None and current[0].shape[s_dim] > 0 and q.numel() > 0:
                gq, gk, gv, gs = torch.ops.opmesh.flash_attn_backward(
                    dout,
                    q,
                    current[0],
                    current[1],
                    out,
                    lse,
                    dlse=dlse,
                    sinks=sinks if step == 0 else None,
                    mask_mode=mode,
                    **options,
                )
                dq += gq.float()
                current = (current[0], current[1], current[2] + gk.float(), current[3] + gv.float())
                if step == 0 and sinks is not None:
                    dsinks = gs
            # Pass the chunk on; after size steps every chunk is back with its owner.
            incoming = ring.lengths[(ring.position - step - 1) % ring.size]
            requests, received = _shift(current, ring, incoming, (s_dim,) * 4)
            for request in requests:
                request.wait()
            current = tuple(received)
        if sinks is not None and dsinks is None:
            dsinks = torch.zeros_like(sinks)
        return (
            dq.to(q.dtype),
            current[2].to(k.dtype),
            current[3].to(v.dtype),
            dsinks,
            None,
            None,
            None,
        )


def check(call):
    """The ring's conditions on a call whose query sequence is sharded (``call``: the layouts
    of an attention call, q first): BSND or BNSD, no mask but the causal one, keys sharded as
    the queries (the chunks that travel), contiguous shards."""
    if call.layout_q == "TND":
        raise ValueError(
            "layout_q: TND context parallel uses the all-gather strategy (in sequence or "
            "head-tail order), not the ring"
        )
    if call.mode not in (0, 3):
        raise ValueError(
            f"mask_mode: the ring strategy supports masks 0 and 3, got {call.mode}; use "
            "context_parallel='all_gather' for windows"
        )
    q_layout, s = call.layouts[0], call.s
    for name, lay in zip(call.names[1:], call.layouts[1:], strict=True):
        if lay.tensor_map[s] != q_layout.tensor_map[s]:
            raise ValueError(
                f"{name}: dim {s} is sharded over mesh axes {lay.axes_text(s)}; the ring "
                f"strategy needs it sharded as q's ({q_layout.axes_text(s)})"
            )
    if call.mode == 3 and q_layout.shape[s] != call.layouts[1].shape[s]:
        raise ValueError(
            f"k: the ring strategy with a causal mask needs as many keys as queries, got "
            f"{call.layouts[1].shape[s]} and {q_layout.shape[s]}"
        )
    if call.order is not None:
        raise ValueError(
            "head_tail_cp: the ring strategy takes contiguous shards; use "
            "context_parallel='all_gather' with head-tail order"
        )


class RingLocal:
    """The ring strategy's local call: the rank's query heads' sinks, and ``RingAttention``
    over the group of the query sequence's mesh axis. ``dims``: the (batch, sequence, heads,
    head dim) positions of the layout."""

    def __init__(self, func, layout, layout_out, dims, q_layout, k_shape, slice_sinks):
        b, s, n, _ = dims
        p = _platform.current()
        axis = q_layout.tensor_map[s][0]
        size = p.mesh_shape(q_layout.mesh)[axis]
        lengths = shard_sizes(k_shape[s], size)  # the chunks that travel are the keys'
        self.ring = RingGroup(
            p.axis_group(q_layout.mesh, axis), p.mesh_coordinate(q_layout.mesh)[axis], size, lengths
        )
        self.layout, self.layout_out = layout, layout_out
        self.heads = q_layout.shard_range(n)
        self.slice_sinks = slice_sinks

    def __call__(self, q, k, v, **kwargs):
        sinks = kwargs.get("sinks")
        if self.slice_sinks:
            sinks = head_slice(sinks, self.heads)
        options = dict(
            layout_q=self.layout,
            layout_kv=self.layout,
            layout_out=self.layout_out,
            softmax_scale=kwargs.get("softmax_scale"),
            softcap=kwargs.get("softcap", 0.0),
        )
        out, lse = RingAttention.apply(
            q, k, v, sinks, self.ring, kwargs.get("mask_mode", 0) == 3, options
        )
        if not kwargs.get("return_softmax_lse", False):
            lse = torch.empty(0, device=q.device)
        return out, lse
