"""Layout: how one tensor is spread over a device mesh, in the terms layout rules need."""

from __future__ import annotations

from dataclasses import dataclass

from .. import platform as _platform


@dataclass(frozen=True)
class Layout:
    """A tensor's (mesh, placements) seen per tensor dim.

    ``tensor_map[d]`` lists the mesh axes (in placement order) that shard tensor dim ``d``; an
    empty tuple means the dim is replicated. Which rows a rank holds is the framework's answer
    (``shard_range``), never recomputed here: sizes that do not divide the mesh, and one dim
    split over several mesh axes (split one axis at a time), come out as the framework lays
    them.
    """

    mesh: object
    placements: tuple
    shape: tuple[int, ...]

    @classmethod
    def of(cls, dtensor) -> Layout:
        p = _platform.current()
        return cls(p.mesh_of(dtensor), p.placements_of(dtensor), p.global_shape(dtensor))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return _platform.current().mesh_axis_names(self.mesh)

    @property
    def tensor_map(self) -> tuple[tuple[int, ...], ...]:
        p = _platform.current()
        axes: list[list[int]] = [[] for _ in range(self.ndim)]
        for axis, placement in enumerate(self.placements):
            dim = p.shard_dim(placement)
            if dim is not None:
                axes[dim % self.ndim].append(axis)
        return tuple(tuple(a) for a in axes)

    def partial_axes(self) -> tuple[int, ...]:
        p = _platform.current()
        return tuple(i for i, pl in enumerate(self.placements) if p.is_partial(pl))

    def num_shards(self, dim: int) -> int:
        sizes = _platform.current().mesh_shape(self.mesh)
        n = 1
        for axis in self.tensor_map[dim]:
            n *= sizes[axis]
        return n

    def shard_index(self, dim: int) -> int:
        """This rank's shard of tensor dim `dim` (row-major over the mesh axes sharding it, in
        placement order)."""
        p = _platform.current()
        sizes, coord = p.mesh_shape(self.mesh), p.mesh_coordinate(self.mesh)
        index = 0
        for axis in self.tensor_map[dim]:
            index = index * sizes[axis] + coord[axis]
        return index

    def shard_range(self, dim: int) -> tuple[int, int]:
        """[start, end) of this rank's shard of dim `dim` in the global tensor."""
        local, offset = _platform.current().local_shape_and_offset(
            self.mesh, self.placements, self.shape
        )
        if not offset:  # a rank outside the mesh holds nothing
            return 0, 0
        return offset[dim], offset[dim] + local[dim]

    def axes_text(self, dim: int) -> str:
        names = self.axis_names
        return ", ".join(repr(names[a]) for a in self.tensor_map[dim]) or "none"
