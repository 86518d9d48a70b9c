"""A user extension addressed by dotted path: 'pkg.module:function' or 'pkg.module.function'."""

from __future__ import annotations

import importlib
from collections.abc import Callable

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
