"""The MindSpore platform: ``mindspore.common._grad_function._Function`` as the autograd base.

opmesh runs on MindSpore tensors on one process (CPU). Distributed execution (DTensor, device
meshes) is not supported there: every distributed method raises NotImplementedError saying so.
"""

from __future__ import annotations

from . import Platform, positional

_NO_MESH = (
    "opmesh on MindSpore runs on one process: distributed (DTensor) execution is not supported "
    "there; use PyTorch tensors for device meshes (docs/mindspore.md)"
)


class MindSporePlatform(Platform):
    name = "mindspore"

    def __init__(self):
        import mindspore  # noqa: F401  (fails here, clearly, when MindSpore is not installed)
        from mindspore.common._grad_function import _Function

        self._function = _Function
        self._adapters: dict[type, type] = {}

    @property
    def Function(self):  # noqa: N802
        return self._function

    @property
    def DTensor(self):  # noqa: N802
        raise NotImplementedError(_NO_MESH)

    def is_tensor(self, value):
        import mindspore

        return isinstance(value, mindspore.Tensor)

    def is_dtensor(self, value):
        return False

    def apply_function(self, cls, args, kwargs):
        """Runs a DFunction subclass as a MindSpore autograd Function on local tensors: the class
        itself when it derives from MindSpore's base, else a MindSpore Function made once per
        class from its forward and backward."""
        values = positional(cls.forward, args, kwargs)
        if issubclass(cls, self._function):
            return self._function.apply.__func__(cls, *values)
        adapter = self._adapters.get(cls)
        if adapter is None:
            adapter = type(
                cls.__name__,
                (self._function,),
                {
                    "forward": staticmethod(cls.forward),
                    "backward": staticmethod(cls.backward),
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                },
            )
            self._adapters[cls] = adapter
        return adapter.apply(*values)

    def _no_mesh(self, *args, **kwargs):
        raise NotImplementedError(_NO_MESH)

    to_local = from_local = redistribute = local_shape_and_offset = _no_mesh
    mesh_of = placements_of = global_shape = mesh_axis_names = mesh_shape = _no_mesh
    mesh_coordinate = shard_dim = is_partial = shard = replicate = partial = _no_mesh
    axis_group = _no_mesh
