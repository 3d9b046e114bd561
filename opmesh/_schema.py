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


def schema_names() -> tuple[str, ...]:
    """Every operator's name (``torch.ops.opmesh.<name>``)."""
    return tuple(_SCHEMAS)


def positional(op_name: str) -> tuple[str, ...]:
    """The names of ``op_name``'s positional parameters, in order."""
    return _POSITIONAL[op_name]


def tensor_parameters(op_name: str) -> tuple[str, ...]:
    """The names of ``op_name``'s parameters that take a tensor (or a list of them)."""
    return _TENSORS[op_name]


def check_scalar_types(op_name: str, call: dict, _bool=bool, _type=type) -> None:
    """Refuses, with a ``TypeError`` naming the argument, a bool where ``op_name`` declares an
    int, and a value other than a bool, 0 or 1 where it declares a bool (the operator itself
    would take ``True`` as 1 and any nonzero int as true). About 0.2 us a call."""
    ints, bools = _SCALARS[op_name]
    for name in ints:
        if _type(call.get(name)) is _bool:
            raise TypeError(f"{name}: expected an int, got a bool ({call[name]!r})")
    for name in bools:
        value = call.get(name, False)
        if _type(value) is not _bool and not (_type(value) is int and value in (0, 1)):
            raise TypeError(
                f"{name}: expected a bool (or 0 or 1), got {value!r} ({_type(value).__name__})"
            )


_SCALARS = {name: (_INTS[name], _BOOLS[name]) for name in _SCHEMAS}


def defaults(op_name: str) -> dict:
    """``op_name``'s parameters that have a default, with it."""
    return dict(_DEFAULTS[op_name])


# Per operator: the parameters whose default is None, and the other defaults by name.
_DEFAULT_SPLIT = {
    name: (
        frozenset(n for n, d in found.items() if d is None),
        {n: d for n, d in found.items() if d is not None},
    )
    for name, found in _DEFAULTS.items()
}


def without_defaults(op_name: str, kwargs: dict, _type=type) -> dict:
    """``kwargs`` less the entries that equal their schema default (None, or a number, bool or
    string of the default's own type): the operator fills those in itself, and every keyword an
    operator call is given costs its argument parsing time (about 0.3 us each). One loop over
    the call, a None tested against the set of None defaults first (most of a call's keywords):
    about 1.3 us for flash_attn's 23 parameters."""
    nones, others = _DEFAULT_SPLIT[op_name]
    kept = {}
    for n, v in kwargs.items():
        if v is None:
            if n in nones:
                continue
        elif n in others:
            d = others[n]
            if _type(v) is _type(d) and v == d:
                continue
        kept[n] = v
    return kept


#: flash_attn's length arrays (the tensors flash_attn_metadata plans from).
ATTN_LENGTHS = tuple(
    a.name for a in _SCHEMAS["flash_attn_metadata"] if str(a.type) == "Optional[Tensor]"
)
#: The indexer family's unbounded band (the default of ``pre_tokens`` and ``next_tokens``).
UNBOUNDED = _DEFAULTS["dense_lightning_indexer_softmax_lse"]["pre_tokens"]
#: The kernels' token limit: a band side or window this long or longer covers every key.
MAX_TOKENS = _C.MAX_TOKENS
