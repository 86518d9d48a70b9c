"""Import-only stand-in for `sgl_kernel` (SGLang's CUDA kernels) on CPU-only machines.

SGLang imports sgl_kernel at module level even when it runs the torch-native CPU path, and no CPU build
exists on PyPI. Every top-level attribute resolves to a function that raises NotImplementedError naming
the op, so a code path that really needs a kernel fails loudly instead of computing garbage. Submodules
(sgl_kernel.scalar_type, .kvcacheio, ...) do not exist: SGLang catches that ImportError and falls back.
Only ever installed into .venv-sglang by tools/setup_sglang_env.sh.
"""

from __future__ import annotations

import sys
import types

__version__ = "0.4.10"


def _missing(qualname: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel stand-in: op {qualname!r} was called; it has no CPU implementation. "
            "Run SGLang on a GPU or avoid the code path that needs it."
        )

    op.__name__ = qualname.rsplit(".", 1)[-1]
    op.__qualname__ = qualname
    return op


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _missing(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


sys.modules[__name__].__class__ = _StubModule
