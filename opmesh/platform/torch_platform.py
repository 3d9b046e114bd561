"""The PyTorch platform: torch.autograd.Function and torch.distributed.tensor.DTensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .._bounded_cache import BoundedCache
from . import Platform, positional


def _global(shape):
    """DTensor.from_local's arguments for a global shape (contiguous strides), if one is given."""
    if shape is None:
        return {}
    return {"shape": torch.Size(shape), "stride": _contiguous_strides(shape)}


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class TorchPlatform(Platform):
    name = "torch"

    @property
    def Function(self):  # noqa: N802
        return torch.autograd.Function

    @property
    def DTensor(self):  # noqa: N802
        return DTensor

    def is_dtensor(self, value):
        return isinstance(value, DTensor)

    def is_tensor(self, value):
        return isinstance(value, torch.Tensor)

    def apply_function(self, cls, args, kwargs):
        """A DFunction subclass derived from torch's Function runs as one; another (derived from
        a different default platform's base) runs through a torch Function made once per class
        from its forward and backward."""
        if issubclass(cls, torch.autograd.Function):
            return cls._local_apply(*args, **kwargs)
        adapter = self._adapters.get(cls)
        if adapter is None:
            adapter = type(
                cls.__name__,
                (torch.autograd.Function,),
                {
                    "forward": staticmethod(cls.forward),
                    "backward": staticmethod(cls.backward),
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                },
            )
            self._adapters[cls] = adapter
        return adapter.apply(*positional(cls.forward, args, kwargs))

    def __init__(self):
        self._specs = BoundedCache()
        self._offsets = BoundedCache()
        self._adapters: dict[type, type] = {}

    def to_local(self, dtensor, grad_placements=None):
        # The differentiable view only when a gradient can flow; otherwise the shard itself
        # (DTensor.to_local costs an autograd Function call).
        if dtensor.requires_grad and torch.is_grad_enabled():
            if grad_placements is not None:
                return dtensor.to_local(grad_placements=tuple(grad_placements))
            return dtensor.to_local()
        return dtensor._local_tensor

    def from_local(self, local, mesh, placements, shape=None):
        if local.requires_grad and torch.is_grad_enabled():
            return DTensor.from_local(local, mesh, placements, run_check=False, **_global(shape))
        # Without autograd, reuse the spec DTensor.from_local computed for this (mesh,
        # placements, global shape, local shape, strides, dtype): building it again costs ~25 us.
        key = (mesh, placements, shape, local.shape, local.stride(), local.dtype)
        spec = self._specs.get(key)
        if spec is None:
            out = DTensor.from_local(local, mesh, placements, run_check=False, **_global(shape))
            self._specs.put(key, out._spec)
            return out
        return DTensor(local, spec, requires_grad=False)

    def redistribute(self, dtensor, mesh, placements):
        return dtensor.redistribute(mesh, placements)

    def local_shape_and_offset(self, mesh, placements, shape):
        key = (mesh, placements, shape)
        found = self._offsets.get(key)
        if found is None:
            local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
            found = (tuple(local), tuple(offset))
            self._offsets.put(key, found)
        return found

    def mesh_of(self, dtensor):
        return dtensor.device_mesh

    def placements_of(self, dtensor):
        return tuple(dtensor.placements)

    def global_shape(self, dtensor):
        return tuple(dtensor.shape)

    def check_global_call(self, op_name, args, kwargs):
        def stand_in(x):
            if not isinstance(x, torch.Tensor):
                return x
            return torch.empty(x.shape, dtype=x.dtype, device="meta")

        op = getattr(torch.ops.opmesh, op_name)
        with torch.no_grad():
            op(*(stand_in(a) for a in args), **{k: stand_in(v) for k, v in kwargs.items()})

    def mesh_axis_names(self, mesh):
        names = mesh.mesh_dim_names
        return tuple(names) if names else tuple(f"axis{i}" for i in range(mesh.ndim))

    def mesh_shape(self, mesh):
        return tuple(mesh.shape)

    def mesh_coordinate(self, mesh):
        return tuple(mesh.get_coordinate())

    def shard_dim(self, placement):
        return placement.dim if isinstance(placement, Shard) else None

    def is_partial(self, placement):
        return isinstance(placement, Partial)

    def shard(self, dim):
        return Shard(dim)

    def replicate(self):
        return Replicate()

    def partial(self):
        return Partial()

    def axis_group(self, mesh, axis):
        return mesh.get_group(axis)
