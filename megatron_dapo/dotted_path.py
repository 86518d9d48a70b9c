"""A user extension addressed by dotted path: 'pkg.module:function' or 'pkg.module.function'."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from megatron_dapo.errors import UserError


def import_callable(path: str, flag: str, expected: str) -> Callable:
    """The callable `path` names; UserError naming `flag` (and saying what was `expected`) when the module does
    not import, lacks the attribute, or the attribute is not callable."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise UserError(f"{flag} {path!r} is not a known name or a dotted path; {expected}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"{flag} {path!r}: cannot import module {module_name!r} ({err}); check the spelling and "
                        "that the package is on PYTHONPATH") from err
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{flag} {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"{flag} {path!r} names a {type(obj).__name__}, not a function; {expected}")
    return obj


def resolve_callable(name: object, flag: str, registry: Mapping[str, Callable], signature: str, *,
                     unknown: str = "is not registered") -> Callable:
    """The function registered as `name`, or the one its dotted path names; UserError naming `flag` (and listing
    the registered names and the expected `signature`) for an empty value, an unknown bare name, or a path that
    does not resolve to a callable. Signature checks are the caller's: only it knows how to call the function."""
    expected = ("expected one of " + ", ".join(repr(k) for k in registry)
                + f" or a dotted path 'pkg.module:function' to {signature}")
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"{flag} must be a non-empty string; {expected}")
    name = name.strip()
    if name in registry:
        return registry[name]
    if "." not in name and ":" not in name:
        raise UserError(f"{flag} {name!r} {unknown}; {expected}")
    return import_callable(name, flag, expected)
