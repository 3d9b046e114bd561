"""The operators' schemas as Python reads them: each operator's arguments (names, order, which
are positional, defaults) come from its one declaration in csrc/common/op_defs.h, through the
schema the extension registers, so no Python module writes them again. Read once at import, as
plain tuples and dicts (torch.compile reads those without tracing the schema objects)."""

from __future__ import annotations

import torch

from . import _C  # (loading it registers torch.ops.opmesh.*)

_SCHEMAS = {
    s.name.split("::", 1)[1]: s.arguments
    for s in torch._C._jit_get_all_schemas()
    if s.name.startswith("opmesh::")
}
_POSITIONAL = {
    name: tuple(a.name for a in arguments if not a.kwarg_only)
    for name, arguments in _SCHEMAS.items()
}
_DEFAULTS = {
    name: {a.name: a.default_value for a in arguments if a.has_default_value()}
    for name, arguments in _SCHEMAS.items()
}
_INTS = {
    name: tuple(a.name for a in arguments if str(a.type) in ("int", "Optional[int]"))
    for name, arguments in _SCHEMAS.items()
}
_BOOLS = {
    name: tuple(a.name for a in arguments if str(a.type) == "bool")
    for name, arguments in _SCHEMAS.items()
}
_TENSORS = {
    name: tuple(a.name for a in arguments if "Tensor" in str(a.type))
    for name, arguments in _SCHEMAS.items()
}


def positional(op_name: str) -> tuple[str, ...]:
    """The names of ``op_name``'s positional parameters, in order."""
    return _POSITIONAL[op_name]


def tensor_parameters(op_name: str) -> tuple[str, ...]:
    """The names of ``op_name``'s parameters that take a tensor (or a list of them)."""
    return _TENSORS[op_name]


def check_scalar_types(op_name: str, call: dict) -> None:
    """Refuses, with a ``TypeError`` naming the argument, a bool where ``op_name`` declares an
    int, and a value other than a bool, 0 or 1 where it declares a bool (the operator itself
    would take ``True`` as 1 and any nonzero int as true)."""
    for name in _INTS[op_name]:
        if type(call.get(name)) is bool:
            raise TypeError(f"{name}: expected an int, got a bool ({call[name]!r})")
    for name in _BOOLS[op_name]:
        value = call.get(name, False)
        if type(value) is not bool and not (type(value) is int and value in (0, 1)):
            raise TypeError(
                f"{name}: expected a bool (or 0 or 1), got {value!r} ({type(value).__name__})"
            )


def defaults(op_name: str) -> dict:
    """``op_name``'s parameters that have a default, with it."""
    return dict(_DEFAULTS[op_name])


def without_defaults(op_name: str, kwargs: dict) -> dict:
    """``kwargs`` less the entries that equal their schema default (None, or a number, bool or
    string of the default's own type): the operator fills those in itself, and every keyword an
    operator call is given costs its argument parsing time (about 0.3 us each)."""
    found = _DEFAULTS[op_name]
    return {
        n: v
        for n, v in kwargs.items()
        if n not in found
        or not (v is None if found[n] is None else type(v) is type(found[n]) and v == found[n])
    }


#: flash_attn's length arrays (the tensors flash_attn_metadata plans from).
ATTN_LENGTHS = tuple(
    a.name for a in _SCHEMAS["flash_attn_metadata"] if str(a.type) == "Optional[Tensor]"
)
#: The indexer family's unbounded band (the default of ``pre_tokens`` and ``next_tokens``).
UNBOUNDED = _DEFAULTS["dense_lightning_indexer_softmax_lse"]["pre_tokens"]
#: The kernels' token limit: a band side or window this long or longer covers every key.
MAX_TOKENS = _C.MAX_TOKENS
