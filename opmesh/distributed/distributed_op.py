"""DistributedOp: the layout rules of one op, and the registry that finds them by op name."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

YAML_DIR_ENV = "OPMESH_DISTRIBUTED_OP_YAML_DIR"
MODULE_PATH_ENV = "OPMESH_DISTRIBUTED_OP_PATH"
_PACKAGE_YAML = Path(__file__).resolve().parent / "yaml"

_instances: dict[str, DistributedOp] = {}
_declared: dict[str, tuple[str, str, str]] | None = None  # op name -> (class, module, yaml file)


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
    """

    def __init__(self, op_name: str):
        if op_name in _instances:
            raise ValueError(
                f"DistributedOp {op_name!r} is already registered "
                f"({type(_instances[op_name]).__qualname__}); op names must be unique"
            )
        self.op_name = op_name
        _instances[op_name] = self

    def preprocess(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, object]:
        raise NotImplementedError(f"{type(self).__qualname__}.preprocess")

    def infer_layout(self, cache_values) -> tuple[tuple, object]:
        raise NotImplementedError(f"{type(self).__qualname__}.infer_layout")

    def get_expand_impl(self, func, infer_result, cache_values):
        return None


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
    import yaml

    for directory in filter(None, os.environ.get(MODULE_PATH_ENV, "").split(os.pathsep)):
        if directory not in sys.path:
            sys.path.append(directory)
    declared: dict[str, tuple[str, str, str]] = {}
    for path in _yaml_files():
        entries = yaml.safe_load(path.read_text()) or {}
        if not isinstance(entries, dict):
            raise ValueError(f"{path}: expected a mapping of op names to entries")
        for name, entry in entries.items():
            if not isinstance(entry, dict) or not {
                "distributed_op_class",
                "distributed_op_file",
            } <= set(entry):
                raise ValueError(
                    f"{path}: entry {name!r} needs 'distributed_op_class' and 'distributed_op_file'"
                )
            if name in declared:
                raise ValueError(
                    f"distributed op {name!r} is declared twice: in {declared[name][2]} and in "
                    f"{path}"
                )
            declared[name] = (
                entry["distributed_op_class"],
                entry["distributed_op_file"],
                str(path),
            )
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
        getattr(module, class_name)()
    return _instances.get(op_name)


def reset_registry_for_tests() -> None:
    """Forgets the YAML declarations (re-read on next lookup); registrations stay."""
    global _declared
    _declared = None
