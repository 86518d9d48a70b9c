"""Importing megatron-core without importing torch's compiler: its torch.compile calls are deferred to first use.

megatron-core 0.16.1 decorates its fusion functions with `jit_fuser = torch.compile` as its modules are imported
(megatron/core/jit.py, megatron/core/fusions/*). `torch.compile(fn)` imports torch._dynamo and torch._inductor
on the spot (its cost: docs/BENCHMARKS.md, "Start-up"); every rank and every tool would pay it at start-up,
although on CPU the fusions are off (models/config.py) and those functions are never called. `install()` (run by
`megatron_dapo/__init__.py`) defers each such compile to the function's first call, which is then compiled exactly
as it would have been: the same `torch.compile` with the same arguments, once.

It acts only while megatron-core's package `__init__` runs (the whole import chain that applies `jit_fuser`),
through a meta-path finder that wraps that one module's loader; `torch.compile` is restored after it. A process
that imports megatron-core before megatron_dapo is unaffected.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

TARGET = "megatron.core"


def deferred(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for `compile_fn` (torch.compile): for a plain function it returns a wrapper that calls
    `compile_fn(fn, **kwargs)` at its first call and the compiled function from then on; anything else (a module,
    no function yet) goes to `compile_fn` at once."""

    def compile_later(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # @torch.compile(mode=...): the decorator that the options give
            return lambda fn: compile_later(fn, **kwargs)
        if not inspect.isfunction(model):
            return compile_fn(model, **kwargs)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(compile_fn(model, **kwargs))
            return compiled[0](*args, **kw)

        call.compile_deferred = True
        return call

    return compile_later


@contextmanager
def torch_compile_deferred() -> Iterator[None]:
    """Within: `torch.compile` is `deferred(torch.compile)`; restored on the way out."""
    import torch

    real = torch.compile
    torch.compile = deferred(real)
    try:
        yield
    finally:
        torch.compile = real


class _DeferringLoader(importlib.abc.Loader):
    """Runs one module's own loader with torch.compile deferred, then puts that loader back on the module."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):  # noqa: ANN001, ANN201 (importlib's signature)
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001
        try:
            with torch_compile_deferred():
                self.inner.exec_module(module)
        finally:
            module.__loader__ = self.inner
            if module.__spec__ is not None:
                module.__spec__.loader = self.inner


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core` as the finders after it would (the same spec), with its loader wrapped; leaves
    sys.meta_path at its first use."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _DeferringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Defer torch.compile during megatron-core's import, if megatron-core has not been imported yet."""
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
