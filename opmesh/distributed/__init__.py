"""Ops on sharded tensors: DFunction, the dispatcher, DistributedOp and its registry, Layout,
and context-parallel helpers (docs/distributed.md)."""

from .context_parallel import from_head_tail, head_tail_cp, set_head_tail_cp, to_head_tail
from .dfunction import DFunction
from .dispatcher import DISPATCHER, OpDispatcher
from .distributed_op import DistributedOp, get_distributed_op
from .gather_cache import gather_once, prefetch_gather
from .layout import Layout

__all__ = [
    "DFunction",
    "DISPATCHER",
    "DistributedOp",
    "Layout",
    "OpDispatcher",
    "from_head_tail",
    "gather_once",
    "get_distributed_op",
    "head_tail_cp",
    "prefetch_gather",
    "set_head_tail_cp",
    "to_head_tail",
]
