"""Making an existing eager-only op graph-ready from Python alone (docs/plugin_path.md).

`define_eager_ops` stands in for an extension someone else built: it has schemas and CPU
kernels but no fake (meta) implementations, so `torch.compile(fullgraph=True)` cannot trace it.
`make_graph_ready` fixes that without rebuilding anything: it registers fake implementations,
and it wraps an in-place op whose schema does not declare its mutation in a new op that does, so
functionalization knows the tensor changes.
"""

from __future__ import annotations

import torch


def define_eager_ops(ns: str) -> torch.library.Library:
    """The existing ops, in namespace `ns`: eager CPU kernels only."""
    lib = torch.library.Library(ns, "DEF")
    # A functional op.
    lib.define("rowsum_scale(Tensor x, float scale) -> Tensor")
    lib.impl("rowsum_scale", lambda x, scale: x.sum(-1) * scale, "CPU")
    # An in-place op that declares its mutation: Tensor(a!).
    lib.define("clamp_rows_(Tensor(a!) x, float limit) -> ()")

    def clamp_rows_(x, limit):
        x.clamp_(-limit, limit)

    lib.impl("clamp_rows_", clamp_rows_, "CPU")
    # An in-place op whose schema forgot to say so (it returns the tensor it changed).
    lib.define("shift_(Tensor x, float by) -> Tensor")
    lib.impl("shift_", lambda x, by: x.add_(by), "CPU")
    return lib


def make_graph_ready(ns: str):
    """Registers what torch.compile and torch.export need; returns the corrected shift op."""
    ops = getattr(torch.ops, ns)

    @torch.library.register_fake(f"{ns}::rowsum_scale")
    def _rowsum_scale_fake(x, scale):
        return x.new_empty(x.shape[:-1])  # shapes only, symbolic sizes welcome

    @torch.library.register_fake(f"{ns}::clamp_rows_")
    def _clamp_rows_fake(x, limit):
        return None  # mutation declared by Tensor(a!): functionalization handles it

    # shift_ mutates x but its schema does not say so: wrap it in an op that declares the
    # mutation (mutates_args) and calls the old kernel, and use the wrapper from now on.
    @torch.library.custom_op(f"{ns}::shift_declared_", mutates_args=("x",))
    def shift_declared_(x: torch.Tensor, by: float) -> None:
        ops.shift_(x, by)

    @shift_declared_.register_fake
    def _shift_fake(x, by):
        return None

    return shift_declared_


def model(ops, shift, x):
    """A small computation using all three ops."""
    ops.clamp_rows_(x, 1.5)
    shift(x, 0.25)
    return ops.rowsum_scale(x, 2.0)
