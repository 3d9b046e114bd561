"""Ulysses (all-to-all) context parallel, and its hybrids with a second strategy.

The query, key and value sequences are sharded alike over the context-parallel mesh axis. Each
rank exchanges its tensors all-to-all (``all_to_all.py``: one ``all_to_all_single`` per tensor)
into full sequences sharded by heads, attends its heads locally, and exchanges the output (and
the lse) back. Key and value heads fewer than the ranks are repeated just enough for every
rank's query heads to find theirs. With a second strategy (``("ulysses", "ring")`` or
``("ulysses", "all_gather")``) the sequence is sharded over two mesh axes: the first is exchanged
all-to-all, the second runs that strategy on the head-sharded tensors (a nested call of the
operator on DTensors).

The strategy reads an attention call's layouts (q, k and v; ``call.names``) and the layout's
(batch, sequence, heads, head dim) positions; the operator hands the local call its per-head
arguments' slicing and the nested call for the hybrids.
"""

from __future__ import annotations

from ... import platform as _platform
from ..all_to_all import AllToAll
from ..context_parallel import from_head_tail, to_head_tail
from ..layout import Layout
from .data_parallel import shard_sizes
from .description import fail_sharded
from .heads import kv_repeat


class Ulysses:
    """The strategy: its conditions on the call (``requested``: ``"ulysses"`` or a two-axis
    hybrid ``("ulysses", inner)``)."""

    name = "ulysses"

    def __init__(self, requested):
        self.inner = None
        if isinstance(requested, tuple):
            if (
                len(requested) != 2
                or requested[0] != "ulysses"
                or requested[1]
                not in (
                    "ring",
                    "all_gather",
                )
            ):
                raise ValueError(
                    "context_parallel: a two-axis strategy is ('ulysses', 'ring') or "
                    f"('ulysses', 'all_gather'), got {requested!r}"
                )
            self.inner = requested[1]

    def prepare(self, call, args, kwargs):
        q_layout, s, n = call.layouts[0], call.s, call.n
        axes = q_layout.tensor_map[s]
        want = 1 if self.inner is None else 2
        if len(axes) != want:
            what = "one mesh axis" if want == 1 else "two mesh axes (Ulysses over the first)"
            strategy = "'ulysses'" if self.inner is None else f"('ulysses', {self.inner!r})"
            fail_sharded(
                "q", q_layout, s, f"context_parallel={strategy} needs the query sequence sharded "
                f"over {what}",
            )  # fmt: skip
        for name, lay in zip(call.names[1:], call.layouts[1:], strict=True):
            if lay.tensor_map[s] != axes:
                fail_sharded(
                    name,
                    lay,
                    s,
                    f"Ulysses needs the key sequence sharded as q's ({q_layout.axes_text(s)})",
                )
        if q_layout.tensor_map[n]:
            fail_sharded("q", q_layout, n, "Ulysses shards the heads itself; pass them replicated")
        if self.inner is not None:
            if call.order is not None:
                raise ValueError(
                    "head_tail_cp: the two-axis Ulysses hybrid takes contiguous shards"
                )
            if kwargs.get("sinks") is not None:
                raise ValueError("sinks: not supported by the two-axis Ulysses hybrid")
        for name in ("seqused_q", "seqused_kv", "metadata"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name}: not supported with Ulysses context parallel")
        if kwargs.get("sinks") is not None and call.p.is_dtensor(kwargs["sinks"]):
            if Layout.of(kwargs["sinks"]).tensor_map[0]:
                raise ValueError("sinks: pass them replicated with Ulysses context parallel")
        return args, kwargs


class UlyssesLocal:
    """The local call: one all-to-all per tensor each way.

    ``c`` is the operator's record of the call (mesh, q's, k's and v's placements and global
    shapes, head-tail order, the inner strategy, whether the lse is returned); ``dims``,
    ``out_dims`` and ``lse_dims`` are the (batch, sequence, heads) positions of the inputs, the
    output and the lse. ``local_args(kwargs, heads, batch)`` gives the call's arguments for
    query heads ``heads = [h0, h1)`` and batch entries ``batch``; ``nested(q, k, v, kwargs)``
    runs the operator on DTensors (the hybrids' second strategy)."""

    def __init__(self, func, c, dims, out_dims, lse_dims, local_args, nested):
        self.p = _platform.current()
        self.func, self.c = func, c
        self.local_args, self.nested = local_args, nested
        b, s, n = dims[:3]
        self.b, self.s, self.n = b, s, n
        self.out_s, self.out_n = out_dims[1], out_dims[2]
        self.lse_s, self.lse_n = lse_dims[2], lse_dims[1]
        q_layout = Layout(c.mesh, c.placements[0], c.shapes[0])
        self.axis = q_layout.tensor_map[s][0]
        self.cp = self.p.mesh_shape(c.mesh)[self.axis]
        self.position = self.p.mesh_coordinate(c.mesh)[self.axis]
        self.inner = c.inner
        self.repeat = kv_repeat(c.shapes[0][n], c.shapes[1][n], self.cp)
        # Every rank's rows of q's and of k's sequence, and its query and key heads after the
        # exchange (DTensor's split: chunks of the ceiling).
        self.q_rows = shard_sizes(c.shapes[0][s], self.cp)
        self.k_rows = shard_sizes(c.shapes[1][s], self.cp)
        self.q_heads = shard_sizes(c.shapes[0][n], self.cp)
        self.batch = q_layout.shard_range(b) if b is not None else None
        self.k_heads = shard_sizes(c.shapes[1][n] * self.repeat, self.cp)

    def _exchange(self, x, placements, shape, from_dim, to_dim):
        """The hybrid's exchange through DTensor: x's shard with ``from_dim`` sharded over the
        Ulysses axis, as the DTensor with ``to_dim`` sharded there instead."""
        p = self.p
        d = p.from_local(x, self.c.mesh, tuple(placements), tuple(shape))
        target = list(placements)
        target[self.axis] = p.shard(to_dim)
        return p.redistribute(d, self.c.mesh, tuple(target))

    def _to_heads(self, x, s_dim, n_dim, rows, heads):
        group = self.p.axis_group(self.c.mesh, self.axis)
        return AllToAll.apply(x, group, self.position, n_dim, s_dim, heads, rows)

    def _to_rows(self, x, s_dim, n_dim, rows, heads):
        group = self.p.axis_group(self.c.mesh, self.axis)
        return AllToAll.apply(x, group, self.position, s_dim, n_dim, rows, heads)

    def __call__(self, q, k, v, **kwargs):
        c, n, s = self.c, self.n, self.s
        if self.repeat > 1:
            k = k.repeat_interleave(self.repeat, dim=n)
            v = v.repeat_interleave(self.repeat, dim=n)
        if self.inner is not None:
            shapes = [list(sh) for sh in c.shapes]
            for sh in shapes[1:]:
                sh[n] *= self.repeat
            moved = [
                self._exchange(x, pl, sh, s, n)
                for x, pl, sh in zip((q, k, v), c.placements, shapes, strict=True)
            ]
            return self._hybrid(moved, kwargs)
        qh = self._to_heads(q, s, n, self.q_rows, self.q_heads)
        kh = self._to_heads(k, s, n, self.k_rows, self.k_heads)
        vh = self._to_heads(v, s, n, self.k_rows, self.k_heads)
        h0 = sum(self.q_heads[: self.position])
        kwargs = self.local_args(kwargs, (h0, h0 + self.q_heads[self.position]), self.batch)
        cu = {}
        if c.order is not None:
            tnd = self.b is None
            cu_q = kwargs["cu_seqlens_q"] if tnd else None
            cu_k = kwargs["cu_seqlens_kv"] if tnd else None
            qh = from_head_tail(qh, s, self.cp, c.order, cu_seqlens=cu_q)
            kh = from_head_tail(kh, s, self.cp, c.order, cu_seqlens=cu_k)
            vh = from_head_tail(vh, s, self.cp, c.order, cu_seqlens=cu_k)
            cu = {"cu_seqlens": cu_q}
        out, lse = self.func(qh, kh, vh, **kwargs)
        if c.order is not None:
            out = to_head_tail(out, self.out_s, self.cp, c.order, **cu)
            if c.return_lse:
                lse = to_head_tail(lse, self.lse_s, self.cp, c.order, **cu)
        out = self._to_rows(out, self.out_s, self.out_n, self.q_rows, self.q_heads)
        # Every rank exchanges the lse when it is asked for (a rank with no heads too).
        if c.return_lse:
            lse = self._to_rows(lse, self.lse_s, self.lse_n, self.q_rows, self.q_heads)
        return out, lse

    def _hybrid(self, moved, kwargs):
        """Ulysses over the first axis, then the second strategy over the second on the
        head-sharded DTensors (a nested call of the operator), and back."""
        p, c = self.p, self.c
        out, lse = self.nested(*moved, {**kwargs, "context_parallel": self.inner})
        target_out = list(p.placements_of(out))
        target_out[self.axis] = p.shard(self.out_s)
        out = p.to_local(p.redistribute(out, c.mesh, tuple(target_out)))
        if c.return_lse:
            target = list(p.placements_of(lse))
            target[self.axis] = p.shard(self.lse_s)
            lse = p.to_local(p.redistribute(lse, c.mesh, tuple(target)))
        else:
            lse = p.to_local(lse)
        return out, lse
