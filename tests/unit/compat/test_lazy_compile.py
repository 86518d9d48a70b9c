"""megatron_dapo.compat.lazy_compile: megatron-core imported through megatron_dapo leaves torch's compiler unloaded
(its fusion functions compile at their first call), and a deferred compile is the same compile, made once."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from megatron_dapo.compat.lazy_compile import deferred
from tests.torchrun import REPO, subprocess_env

PROBE = """
import json, sys
import megatron_dapo.train  # the trainer's whole import, megatron-core included
import torch
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
                  "compile_restored": torch.compile.__module__ == "torch",
                  "swiglu_deferred": getattr(fused_bias_swiglu.bias_swiglu, "compile_deferred", False),
                  "jit_fuser_is_torch_compile": jit.jit_fuser is torch.compile,
                  "loader": type(sys.modules["megatron.core"].__loader__).__name__}))
"""


def test_megatron_core_import_leaves_the_compiler_unloaded():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=subprocess_env(), capture_output=True,
                         text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"dynamo": False, "inductor": False, "compile_restored": True, "swiglu_deferred": True,
                   "jit_fuser_is_torch_compile": False, "loader": "SourceFileLoader"}, got


def test_a_deferred_compile_happens_once_at_the_first_call_with_its_arguments():
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append((getattr(fn, "__name__", type(fn).__name__), kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    later = deferred(fake_compile)

    def double(x):
        return 2 * x

    wrapped = later(double, fullgraph=True)
    assert calls == [] and wrapped.__name__ == "double"
    assert wrapped(3) == ("compiled", 6) and wrapped(x=4) == ("compiled", 8)
    assert calls == [("double", {"fullgraph": True})]

    @later(mode="max-autotune")  # the decorator-factory form
    def triple(x):
        return 3 * x

    assert triple(2) == ("compiled", 6) and calls[-1] == ("triple", {"mode": "max-autotune"})
    later(torch.nn.Linear(2, 2))  # a module (not a function) is compiled at once, as torch.compile would
    assert calls[-1] == ("Linear", {}) and len(calls) == 3


def test_a_deferred_torch_compile_computes_what_eager_does():
    def swiglu(y):
        a, b = torch.chunk(y, 2, -1)
        return torch.nn.functional.silu(a) * b

    y = torch.randn(4, 8, dtype=torch.float64)
    compiled = deferred(torch.compile)(swiglu, backend="eager")
    from torch._dynamo.utils import counters

    frames = counters["frames"]["ok"]
    torch.testing.assert_close(compiled(y), swiglu(y), rtol=0, atol=0)
    assert counters["frames"]["ok"] > frames  # dynamo traced it: a compile, not the plain function
