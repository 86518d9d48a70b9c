"""Functions a flag chooses: registered by name beside their definition (`Registry.register`), or a user
extension addressed by dotted path, 'pkg.module:function' or 'pkg.module.function'."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from megatron_dapo.errors import UserError

F = TypeVar("F", bound=Callable)


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


class Registry(Mapping[str, Callable]):
    """The functions one flag chooses by name (verl's `@register_policy_loss("name")`): each module registers its
    own with `@registry.register("name", help=...)` beside the definition, and every module of `package` is
    imported on the first read, so a new function is one new module there: nothing else lists it (the flag's help,
    its "expected one of" and the parametrized tests read the registry).

    Read as a mapping name -> function, in registration order: the package's `__init__` runs before any of its
    modules (its imports fix the order of theirs), the modules it does not import follow alphabetically."""

    def __init__(self, flag: str, signature: str, package: str, *, unknown: str = "is not registered") -> None:
        self.flag, self.signature, self.package, self.unknown = flag, signature, package, unknown
        self._entries: dict[str, tuple[Callable, str]] = {}
        self._imported = False

    def register(self, name: str, *, help: str = "") -> Callable[[F], F]:
        """Decorator: `fn` under `name` (a bare word: a '.' or ':' would read as a dotted path), with `help`, the
        short description the flag's help text gives it; returns `fn` itself. ValueError for a name taken twice."""
        if not name or any(c in name for c in ".: "):
            raise ValueError(f"{self.flag}: {name!r} cannot be registered: a name is one word without '.' or ':'")

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.flag} {name!r} is registered twice: {qualified_name(self._entries[name][0])} "
                                 f"and {qualified_name(fn)}")
            self._entries[name] = (fn, help)
            return fn

        return decorator

    def _loaded(self) -> dict[str, tuple[Callable, str]]:
        if not self._imported:
            self._imported = True  # first, so a module that reads the registry while it is imported cannot recurse
            for info in pkgutil.iter_modules(importlib.import_module(self.package).__path__):
                importlib.import_module(f"{self.package}.{info.name}")
        return self._entries

    def __getitem__(self, name: str) -> Callable:
        return self._loaded()[name][0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())

    def describe(self) -> str:
        """'name (help), name (help), ...': the registered functions as the flag's help lists them."""
        return ", ".join(f"{name} ({help})" if help else name for name, (_, help) in self._loaded().items())

    def resolve(self, value: object) -> Callable:
        """The function registered as `value`, or the one its dotted path names (`resolve_callable`)."""
        return resolve_callable(value, self.flag, self, self.signature, unknown=self.unknown)


def qualified_name(fn: Callable) -> str:
    """'module:qualname' of a function, for messages (the type's name for a callable object without one)."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
