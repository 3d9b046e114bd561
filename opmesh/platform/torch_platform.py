"""The PyTorch platform: torch.autograd.Function and torch.distributed.tensor.DTensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import Platform


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

    def op_name(self, op):
        name = getattr(op, "_op_name", None)
        if name is None:
            name = getattr(op, "__name__", None) or type(op).__name__
        return name

    def to_local(self, dtensor):
        return dtensor.to_local()

    def from_local(self, local, mesh, placements):
        return DTensor.from_local(local, mesh, placements, run_check=False)

    def mesh_of(self, dtensor):
        return dtensor.device_mesh

    def placements_of(self, dtensor):
        return tuple(dtensor.placements)

    def global_shape(self, dtensor):
        return tuple(dtensor.shape)

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
