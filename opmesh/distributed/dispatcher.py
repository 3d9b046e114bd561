"""The dispatcher: runs an op with DTensor arguments through its DistributedOp."""

from __future__ import annotations

from .. import platform as _platform
from .distributed_op import get_distributed_op


class OpDispatcher:
    """preprocess -> infer_layout (cached) -> get_expand_impl (cached) -> local call -> wrap."""

    def __init__(self):
        self._cache: dict[tuple[str, object], tuple] = {}

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
            self._cache[key] = cached
        (out_layouts, _extra), expand = cached
        outputs = (expand or func)(*local_args, **local_kwargs)
        return self._wrap(outputs, out_layouts)

    @staticmethod
    def _wrap(outputs, out_layouts):
        p = _platform.current()
        single = not isinstance(outputs, (tuple, list))
        items = (outputs,) if single else tuple(outputs)
        if len(items) != len(out_layouts):
            raise RuntimeError(
                f"the op returned {len(items)} outputs but its DistributedOp describes "
                f"{len(out_layouts)}"
            )
        wrapped = tuple(
            out if layout is None else p.from_local(out, layout[0], tuple(layout[1]))
            for out, layout in zip(items, out_layouts, strict=True)
        )
        return wrapped[0] if single else wrapped

    def clear_cache(self):
        self._cache.clear()


DISPATCHER = OpDispatcher()
