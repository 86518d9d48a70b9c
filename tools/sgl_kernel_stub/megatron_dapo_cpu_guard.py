"""Lets PyPI's (CUDA-built) torchvision import next to a CPU torch in .venv-sglang.

torchvision's C++ ops cannot load without libtorch_cuda, and torchvision/_meta_registrations.py then dies at
import ('operator torchvision::nms does not exist'), taking every module that imports torchvision down
(SGLang imports it for its multimodal configs, never for Qwen2). This finder serves that one module as an
empty one when the ops are missing, so `import torchvision` works and any real use of a torchvision op
still fails loudly with torchvision's own "Couldn't load custom C++ ops" error.
Loaded by the .pth file that tools/setup_sglang_env.sh writes; never used in the main .venv.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_GUARDED = "torchvision._meta_registrations"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname != _GUARDED:
            return None
        extension = sys.modules.get("torchvision.extension")
        if extension is not None and extension._has_ops():
            return None  # a working torchvision build: leave it alone
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _Finder())
