"""The dispatcher: runs an op with DTensor arguments through its DistributedOp."""

from __future__ import annotations

from .._bounded_cache import BoundedCache
from .distributed_op import get_distributed_op


class OpDispatcher:
    """preprocess -> infer_layout (cached) -> get_expand_impl (cached) -> local call -> wrap.

    The cache is keyed by the op name and the DistributedOp's ``cache_values`` and holds at most
    ``cache_size`` entries (least recently used dropped first), so a stream of new shapes costs
    recomputation, never unbounded memory.
    """

    def __init__(self, cache_size: int = 256):
        self._cache = BoundedCache(cache_size)

    def dispatch(self, op_name: str, func, args: tuple, kwargs: dict):
        dist_op = get_distributed_op(op_name)
        if dist_op is None:
            raise ValueError(
                f"no DistributedOp is registered for op {op_name!r}: register one with "
                "opmesh.DistributedOp(op_name) or declare it in a registry YAML file "
                "(see docs/distributed.md)"
            )
        local_args, local_kwargs, cache_values = dist_op.preprocess(args, kwargs)
        key = (op_name, cache_values)
        cached = self._cache.get(key)
        if cached is None:
            infer_result = dist_op.infer_layout(cache_values)
            expand = dist_op.get_expand_impl(func, infer_result, cache_values)
            cached = (infer_result, expand)
            self._cache.put(key, cached)
        (out_layouts, _extra), expand = cached
        outputs = (expand or func)(*local_args, **local_kwargs)
        return dist_op.wrap_outputs(outputs, out_layouts)

    def cache_size(self) -> int:
        return len(self._cache)


DISPATCHER = OpDispatcher()
