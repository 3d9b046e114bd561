"""DFunction: a custom autograd function whose forward/backward see local tensors only."""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

from .. import platform as _platform
from ..platform import positional as _positional
from .dispatcher import DISPATCHER


class DFunction(_platform.current().Function):
    """Subclass with ``forward(ctx, ...)`` / ``backward(ctx, ...)`` written on local tensors, and
    ``_op_name`` naming the DistributedOp that knows the op's layouts.

    ``apply(*args, **kwargs)``: with no DTensor among the arguments this is the framework's
    ordinary autograd Function call. Otherwise the dispatcher checks the input layouts, runs
    forward on each rank's local tensors, and wraps the outputs as DTensors; the local tensors
    are taken from the DTensors differentiably, so backward runs on local gradients and the
    caller gets DTensor gradients with the inputs' placements.

    The framework is the one of the arguments' tensors: the same subclass runs on PyTorch and on
    MindSpore tensors (``opmesh.platform``), as long as its forward and backward call only what
    both frameworks' tensors offer (opmesh's operators accept both).
    """

    _op_name: str | None = None

    @classmethod
    def apply(cls, *args, **kwargs):
        if not torch.compiler.is_compiling():
            # Another framework's tensors, or a class built on another framework's base.
            platform = _platform.of_values((*args, *kwargs.values())) or _platform.current()
            if platform.name != "torch" or not issubclass(cls, torch.autograd.Function):
                return platform.apply_function(cls, args, kwargs)
        dtensor = _platform.current().DTensor
        if not any(isinstance(a, dtensor) for a in args) and not any(
            isinstance(v, dtensor) for v in kwargs.values()
        ):
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
            # Autograd takes inputs by position only: keyword and default arguments become
            # positional inputs, and backward returns one gradient per parameter of forward.
            return super().apply(*_positional(cls.forward, args, kwargs))
        # Nothing to differentiate: run forward as a plain call (the autograd Function call
        # itself costs ~10 us, which dominates small ops) with a ctx that behaves as autograd's.
        return cls.forward(_NoGradContext(cls.forward, args, kwargs), *args, **kwargs)


def _records_autograd(args, kwargs) -> bool:
    if not torch.is_grad_enabled():
        return False
    values = (*args, *kwargs.values())
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


class _NoGradContext(FunctionCtx):
    """The ctx forward receives when no input requires a gradient. It is autograd's own ctx
    class, so every method forward may call exists and records what it records there;
    ``needs_input_grad`` holds one False per input of forward (keyword and default arguments
    included, as autograd binds them), and ``saved_tensors`` gives back what was saved."""

    def __init__(self, forward, args, kwargs):
        self._forward = forward
        self._call = (args, kwargs)

    @property
    def needs_input_grad(self) -> tuple[bool, ...]:
        args, kwargs = self._call
        return (False,) * len(_positional(self._forward, args, kwargs))

    @property
    def saved_tensors(self) -> tuple:
        return tuple(getattr(self, "to_save", ()) or ())
