"""DistributedOp: the layout rules of one op, and the registry that finds them by op name."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path

import yaml

from .. import platform as _platform

YAML_DIR_ENV = "OPMESH_DISTRIBUTED_OP_YAML_DIR"
MODULE_PATH_ENV = "OPMESH_DISTRIBUTED_OP_PATH"
_PACKAGE_YAML = Path(__file__).resolve().parent / "yaml"

_instances: dict[str, DistributedOp] = {}
_declared: dict[str, tuple[str, str, str]] | None = None  # op name -> (class, module, yaml file)
DEFAULT_KEY = "__default__"
MODULE_KEYS = ("distributed_op_module", "distributed_op_file")


class DistributedOp:
    """Layout rules of an op on DTensors. Constructing one registers it under ``op_name``.

    The dispatcher calls, for a call with DTensor arguments:

    * ``preprocess(args, kwargs) -> (local_args, local_kwargs, cache_values)``: check the input
      layouts and take the DTensors apart; ``cache_values`` is a hashable summary of everything
      the output layout depends on.
    * ``infer_layout(cache_values) -> (out_layouts, extra)``: one ``(mesh, placements)`` per
      output (None for a non-tensor output); cached by ``cache_values``.
    * ``get_expand_impl(func, infer_result, cache_values)``: None to call ``func`` on the local
      tensors as they are, or a callable that replaces that call (context parallel slicing).
    * ``wrap_outputs(outputs, out_layouts)``: turns the local outputs into DTensors; override it
      for outputs that are not one tensor per layout.

    One class may serve several ops: the registry constructs it with each op's name.

    The defaults describe an element-wise op: every tensor argument is a DTensor of the same
    shape and placements (Partial refused), and every output takes that layout.
    """

    def __init__(self, op_name: str):
        if op_name in _instances:
            raise ValueError(
                f"DistributedOp {op_name!r} is already registered "
                f"({type(_instances[op_name]).__qualname__}); op names must be unique"
            )
        self.op_name = op_name
        _instances[op_name] = self

    #: how many outputs the element-wise default describes
    num_outputs = 1

    def preprocess(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, object]:
        """Element-wise default: the DTensors among the positional arguments taken apart; the
        cache values are their (name, mesh, placements, global shape)."""
        p = _platform.current()
        layouts = []
        local_args = []
        for i, value in enumerate(args):
            if p.is_dtensor(value):
                layouts.append(
                    (f"args[{i}]", p.mesh_of(value), p.placements_of(value), p.global_shape(value))
                )
                local_args.append(p.to_local(value))
            else:
                local_args.append(value)
        for name, value in kwargs.items():
            if p.is_dtensor(value):
                raise ValueError(
                    f"{name}: {self.op_name} takes DTensors as positional arguments only"
                )
        return tuple(local_args), dict(kwargs), tuple(layouts)

    def infer_layout(self, cache_values) -> tuple[tuple, object]:
        """Element-wise default: every input has the first one's mesh, placements and shape, none
        is Partial (a sum of element-wise results is not the result of the sums), and each of the
        ``num_outputs`` outputs takes that layout."""
        p = _platform.current()
        if not cache_values:
            raise ValueError(f"{self.op_name}: expected at least one DTensor argument")
        name0, mesh, placements, shape = cache_values[0]
        for name, m, pl, sh in cache_values:
            for axis, placement in enumerate(pl):
                if p.is_partial(placement):
                    raise ValueError(
                        f"{name}: Partial placement on mesh axis "
                        f"{p.mesh_axis_names(m)[axis]!r} is not supported by the element-wise "
                        f"op {self.op_name}; reduce it first"
                    )
            if m != mesh or pl != placements or sh != shape:
                raise ValueError(
                    f"{name}: an element-wise op needs every input laid out as {name0} "
                    f"(placements {placements}, shape {shape}), got placements {pl}, shape {sh}"
                )
        return ((mesh, placements, shape),) * self.num_outputs, None

    def get_expand_impl(self, func, infer_result, cache_values):
        return None

    def wrap_outputs(self, outputs, out_layouts):
        """The local outputs as DTensors: one ``(mesh, placements, global_shape)`` per output
        (None for an output returned as it is)."""
        p = _platform.current()
        single = not isinstance(outputs, (tuple, list))
        items = (outputs,) if single else tuple(outputs)
        if len(items) != len(out_layouts):
            raise RuntimeError(
                f"{self.op_name} returned {len(items)} outputs but its DistributedOp describes "
                f"{len(out_layouts)}"
            )
        wrapped = tuple(
            out
            if layout is None
            else p.from_local(out, layout[0], tuple(layout[1]), *tuple(layout[2:3]))
            for out, layout in zip(items, out_layouts, strict=True)
        )
        return wrapped[0] if single else wrapped


def _yaml_files() -> list[Path]:
    files = sorted(_PACKAGE_YAML.glob("*.yaml"))
    user = os.environ.get(YAML_DIR_ENV)
    if user:
        for directory in user.split(os.pathsep):
            if not Path(directory).is_dir():
                raise ValueError(f"{YAML_DIR_ENV}: {directory!r} is not a directory")
            files += sorted(Path(directory).glob("*.yaml"))
    return files


def _declarations() -> dict[str, tuple[str, str, str]]:
    """Reads every registry YAML file once: op name -> (class, module, file)."""
    global _declared
    if _declared is not None:
        return _declared
    for directory in filter(None, os.environ.get(MODULE_PATH_ENV, "").split(os.pathsep)):
        if directory not in sys.path:
            sys.path.append(directory)
    declared: dict[str, tuple[str, str, str]] = {}
    for path in _yaml_files():
        entries = yaml.safe_load(path.read_text()) or {}
        if not isinstance(entries, dict):
            raise ValueError(f"{path}: expected a mapping of op names to entries")
        defaults = entries.pop(DEFAULT_KEY, None) or {}
        if not isinstance(defaults, dict):
            raise ValueError(f"{path}: {DEFAULT_KEY} must be a mapping of entry keys")
        for name, entry in entries.items():
            if entry is None:
                entry = {}
            if not isinstance(entry, dict):
                raise ValueError(f"{path}: entry {name!r} must be a mapping")
            entry = {**defaults, **entry}
            module = next((entry[k] for k in MODULE_KEYS if k in entry), None)
            if "distributed_op_class" not in entry or module is None:
                raise ValueError(
                    f"{path}: entry {name!r} needs 'distributed_op_class' and "
                    "'distributed_op_module' (or 'distributed_op_file'), given there or under "
                    f"{DEFAULT_KEY}"
                )
            if name in declared:
                raise ValueError(
                    f"distributed op {name!r} is declared twice: in {declared[name][2]} and in "
                    f"{path}"
                )
            declared[name] = (entry["distributed_op_class"], module, str(path))
    _declared = declared
    return declared


def _module_name(file: str) -> str:
    """A registry entry's module: a dotted name, or a bare name looked up in opmesh's ops."""
    if "." in file:
        return file
    packaged = f"opmesh.distributed.ops.{file}"
    return packaged if importlib.util.find_spec(packaged) is not None else file


def get_distributed_op(op_name: str) -> DistributedOp | None:
    """The DistributedOp registered under op_name: programmatic registrations first, then the
    YAML registry (importing the module and instantiating the class on first use)."""
    if op_name in _instances:
        return _instances[op_name]
    entry = _declarations().get(op_name)
    if entry is None:
        return None
    class_name, file, _ = entry
    module = importlib.import_module(_module_name(file))
    if op_name not in _instances:
        cls = getattr(module, class_name)
        cls(op_name) if _takes_op_name(cls) else cls()
    return _instances.get(op_name)


def _takes_op_name(cls) -> bool:
    """Whether the class's constructor takes the op name (one class serving several ops)."""
    params = list(inspect.signature(cls).parameters.values())
    return bool(params) and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    )


def reset_registry_for_tests() -> None:
    """Forgets the YAML declarations (re-read on next lookup); registrations stay."""
    global _declared
    _declared = None
