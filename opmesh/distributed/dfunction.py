"""DFunction: a custom autograd function whose forward/backward see local tensors only."""

from __future__ import annotations

import torch

from .. import platform as _platform
from .dispatcher import DISPATCHER


class DFunction(_platform.current().Function):
    """Subclass with ``forward(ctx, ...)`` / ``backward(ctx, ...)`` written on local tensors, and
    ``_op_name`` naming the DistributedOp that knows the op's layouts.

    ``apply(*args, **kwargs)``: with no DTensor among the positional arguments this is the
    framework's ordinary autograd Function call. Otherwise the dispatcher checks the input
    layouts, runs forward on each rank's local tensors, and wraps the outputs as DTensors;
    the local tensors are taken from the DTensors differentiably, so backward runs on local
    gradients and the caller gets DTensor gradients with the inputs' placements.
    """

    _op_name: str | None = None

    @classmethod
    def apply(cls, *args, **kwargs):
        p = _platform.current()
        if not any(p.is_dtensor(a) for a in args):
            return cls._local_apply(*args, **kwargs)
        if cls._op_name is None:
            raise ValueError(
                f"{cls.__qualname__}: DTensor arguments need the class attribute _op_name, the "
                "name of the DistributedOp that describes the op's layouts"
            )
        return DISPATCHER.dispatch(cls._op_name, cls._local_apply, args, kwargs)

    @classmethod
    def _local_apply(cls, *args, **kwargs):
        if _records_autograd(args, kwargs):
            return super().apply(*args, **kwargs)
        # Nothing to differentiate: run forward as a plain call (the autograd Function call
        # itself costs ~10 us, which dominates small ops).
        return cls.forward(_NoGradContext(), *args, **kwargs)


def _records_autograd(args, kwargs) -> bool:
    if not torch.is_grad_enabled():
        return False
    values = (*args, *kwargs.values())
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


class _NoGradContext:
    """The ctx forward receives when no input requires a gradient: records nothing."""

    needs_input_grad = ()
    saved_tensors = ()

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass
