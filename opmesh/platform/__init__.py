"""The framework-specific pieces of the distributed layer, behind one interface.

Everything in ``opmesh.distributed`` (DFunction, the dispatcher, DistributedOps, Layout) reaches
the framework's autograd and DTensor machinery only through ``opmesh.platform.current()``, so a
second framework (MindSpore) is added by writing one more ``Platform`` subclass.

The default platform is chosen once, at first use, by the environment variable
``OPMESH_PLATFORM``: ``torch`` (the default), ``mindspore``, or ``package.module:ClassName`` for
an out-of-tree implementation. A call whose tensors belong to another framework runs on that
framework's platform (``of_values``): MindSpore tensors run on MindSpore whatever the default.
"""

from __future__ import annotations

import abc
import functools
import importlib
import inspect
import os
import sys
from typing import Any

PLATFORM_ENV = "OPMESH_PLATFORM"
_BUILTIN = {
    "torch": "opmesh.platform.torch_platform:TorchPlatform",
    "mindspore": "opmesh.platform.mindspore_platform:MindSporePlatform",
}
_current: Platform | None = None
_loaded: dict[str, Platform] = {}


class Platform(abc.ABC):
    """What the distributed layer needs from a framework."""

    name: str

    @property
    @abc.abstractmethod
    def Function(self) -> type:  # noqa: N802  (a class, named like one)
        """The autograd Function base class DFunction derives from."""

    @property
    @abc.abstractmethod
    def DTensor(self) -> type:  # noqa: N802
        """The distributed tensor type."""

    @abc.abstractmethod
    def is_dtensor(self, value: Any) -> bool:
        """Whether value is a distributed tensor."""

    @abc.abstractmethod
    def is_tensor(self, value: Any) -> bool:
        """Whether value is one of this framework's tensors (distributed or not)."""

    @abc.abstractmethod
    def apply_function(self, cls: type, args: tuple, kwargs: dict) -> Any:
        """Runs the DFunction subclass ``cls`` on this framework's local tensors with its
        autograd: ``cls.forward(ctx, ...)`` now, ``cls.backward`` when gradients are asked for."""

    @abc.abstractmethod
    def to_local(self, dtensor: Any, grad_placements: tuple | None = None) -> Any:
        """This rank's shard, differentiably (gradients flow back to the DTensor).
        ``grad_placements`` says how the local gradient relates to the global one when it is not
        laid out as the DTensor is (Partial on an axis where each rank holds a partial sum)."""

    @abc.abstractmethod
    def from_local(
        self, local: Any, mesh: Any, placements: tuple, shape: tuple[int, ...] | None = None
    ) -> Any:
        """Wraps a local shard as a DTensor with these placements, differentiably. ``shape`` is
        the global shape (contiguous strides); without it the shards must all be equal."""

    def axis_group(self, mesh: Any, axis: int) -> Any:
        """The process group of one mesh axis (for point-to-point transfers)."""
        raise NotImplementedError(f"{type(self).__qualname__}.axis_group")

    def partial(self) -> Any:
        """A sum-reduction pending placement."""
        raise NotImplementedError(f"{type(self).__qualname__}.partial")

    def redistribute(self, dtensor: Any, mesh: Any, placements: tuple) -> Any:
        """The DTensor laid out by new placements (gathering shards where a placement becomes
        Replicate), differentiably: the gradient comes back in the old layout."""
        raise NotImplementedError(f"{type(self).__qualname__}.redistribute")

    @abc.abstractmethod
    def local_shape_and_offset(
        self, mesh: Any, placements: tuple, shape: tuple[int, ...]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's shard of a tensor of global ``shape`` laid out by ``placements``: its
        local shape and the global index of its first element, per dim, exactly as the
        framework splits it (uneven sizes, one dim over several mesh axes)."""

    @abc.abstractmethod
    def mesh_of(self, dtensor: Any) -> Any:
        """The device mesh a DTensor lives on."""

    @abc.abstractmethod
    def placements_of(self, dtensor: Any) -> tuple:
        """A DTensor's placements, one per mesh axis."""

    @abc.abstractmethod
    def global_shape(self, dtensor: Any) -> tuple[int, ...]:
        """The shape of the whole (unsharded) tensor."""

    def check_global_call(self, op_name: str, args: tuple, kwargs: dict) -> None:
        """Runs the operator's shape function (its checks, no data) on stand-ins of the whole
        problem: DTensors by their global shape, other tensors by theirs. Every rank sees the
        same global problem, so an argument error is raised on every rank alike, before any
        rank computes or communicates."""
        raise NotImplementedError(f"{type(self).__qualname__}.check_global_call")

    @abc.abstractmethod
    def mesh_axis_names(self, mesh: Any) -> tuple[str, ...]:
        """Names of the mesh axes (``axis0``, ``axis1``... when unnamed)."""

    @abc.abstractmethod
    def mesh_shape(self, mesh: Any) -> tuple[int, ...]:
        """Sizes of the mesh axes."""

    @abc.abstractmethod
    def mesh_coordinate(self, mesh: Any) -> tuple[int, ...]:
        """This rank's coordinate on each mesh axis."""

    @abc.abstractmethod
    def shard_dim(self, placement: Any) -> int | None:
        """The tensor dim a placement shards, or None when it does not shard."""

    @abc.abstractmethod
    def is_partial(self, placement: Any) -> bool:
        """Whether a placement is a pending reduction."""

    @abc.abstractmethod
    def shard(self, dim: int) -> Any:
        """The placement sharding tensor dim `dim`."""

    @abc.abstractmethod
    def replicate(self) -> Any:
        """The replicated placement."""


def _load(spec: str) -> Platform:
    if spec in _loaded:
        return _loaded[spec]
    target = _BUILTIN.get(spec, spec)
    module_name, _, class_name = target.partition(":")
    if not class_name:
        raise ValueError(
            f"{PLATFORM_ENV}: expected one of {sorted(_BUILTIN)} or 'package.module:ClassName', "
            f"got {spec!r}"
        )
    cls = getattr(importlib.import_module(module_name), class_name)
    platform = cls()
    if not isinstance(platform, Platform):
        raise TypeError(f"{PLATFORM_ENV}: {target} is not an opmesh.platform.Platform")
    _loaded[spec] = platform
    return platform


def current() -> Platform:
    """The selected platform (``OPMESH_PLATFORM``, default ``torch``)."""
    global _current
    if _current is None:
        _current = _load(os.environ.get(PLATFORM_ENV, "torch"))
    return _current


def get(name: str) -> Platform:
    """A built-in platform by name (``torch`` or ``mindspore``), loaded once."""
    return _load(name)


def is_mindspore_tensor(value) -> bool:
    """Whether value is a MindSpore tensor (never true before MindSpore is imported: no
    MindSpore tensor can exist before)."""
    ms = sys.modules.get("mindspore")
    return ms is not None and isinstance(value, ms.Tensor)


def on_mindspore(*values) -> bool:
    """Whether any of values is a MindSpore tensor: the public functions then run on MindSpore
    (platform/mindspore_ops.py)."""
    return "mindspore" in sys.modules and any(is_mindspore_tensor(v) for v in values)


def scaled_gradients(gradients, grad_loss) -> tuple:
    """The KL loss's backward on either framework: the gradients its fused operator returned,
    each scaled by the loss's incoming gradient in float32 and returned in its own dtype."""
    if on_mindspore(grad_loss):
        return tuple((d.float() * grad_loss).to(d.dtype) for d in gradients)
    # On torch a 0-dim float32 factor takes no part in type promotion: bf16, fp16 and float32
    # gradients are multiplied in float32 and rounded once to their dtype, the same bits as the
    # round trip through a float32 copy, in one pass and without the copies (4x faster).
    # float64 gradients keep the round trip (a float64 product would round differently).
    scale = grad_loss.reshape(())
    return tuple(
        d * scale if d.dtype.itemsize <= 4 else (d.float() * grad_loss).to(d.dtype)
        for d in gradients
    )


def of_values(values) -> Platform | None:
    """The platform of the first framework tensor among ``values`` that is not the default
    platform's, or None (no tensor, or only the default platform's). MindSpore is looked for
    only once it has been imported: no MindSpore tensor can exist before."""
    default = current()
    if default.name != "mindspore" and on_mindspore(*values):
        return get("mindspore")
    if default.name != "torch" and "torch" in sys.modules:
        torch_tensor = sys.modules["torch"].Tensor
        if any(isinstance(v, torch_tensor) for v in values):
            return get("torch")
    return None


@functools.cache
def _signature(forward) -> inspect.Signature:
    return inspect.signature(forward)


def positional(forward, args, kwargs) -> tuple:
    """The arguments of ``forward(ctx, ...)`` bound by position, defaults filled in (autograd
    takes inputs by position; backward returns one gradient per parameter of forward)."""
    signature = _signature(forward)
    if any(p.kind is p.KEYWORD_ONLY for p in signature.parameters.values()):
        raise TypeError(
            f"{forward.__qualname__}: a DFunction's forward cannot take keyword-only "
            "parameters (autograd passes inputs by position)"
        )
    bound = signature.bind(None, *args, **kwargs)
    bound.apply_defaults()
    return bound.args[1:]
