"""Triton kernels: interpreter runs against the references (in a fresh TRITON_INTERPRET=1 process), and
compilation to sm_80/sm_90 cubins without a GPU, which catches errors the interpreter accepts (dtype
mixing, non-constexpr globals, unsupported ops)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.torchrun import REPO

triton = pytest.importorskip("triton")


def test_interpreter_cases_pass():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/dist/ops_triton_interpret.py"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    summary = re.findall(r"^=* ?(\d+ passed.* in [\d.]+s.*)$", out, re.M)  # pytest's last line: "5 passed in 5.0s"
    assert summary and "skipped" not in summary[-1], out[-2000:]


def test_interpreter_env_set_after_import_is_a_clear_error(monkeypatch):
    from megatron_dapo.ops.triton_kernels import interpret_enabled

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton was imported without it in this process
    with pytest.raises(RuntimeError, match="set after triton was imported"):
        interpret_enabled()


def _compile_all(capability: int) -> list:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron_dapo.ops.triton_kernels import grad_kernel, stats_kernel

    target = GPUTarget("cuda", capability, 32)
    out = []
    # Each input dtype once, each constexpr branch at least once: 6 compiles per target.
    for x_ty, acc, flag in (("*fp32", "*fp32", True), ("*bf16", "*fp32", False), ("*fp64", "*fp64", True)):
        stats_sig = {"x_ptr": x_ty, "lt_ptr": "*i64", "m_ptr": acc, "s_ptr": acc, "a_ptr": acc,
                     "xt_ptr": acc, "stride_row": "i64", "V": "i32", "COMPUTE_ENTROPY": "constexpr",
                     "BLOCK_V": "constexpr"}
        grad_sig = {"x_ptr": x_ty, "lt_ptr": "*i64", "lse_ptr": acc, "h_ptr": acc, "glp_ptr": acc,
                    "gh_ptr": acc, "dx_ptr": x_ty, "stride_row": "i64", "stride_drow": "i64", "V": "i32",
                    "HAS_ENTROPY_GRAD": "constexpr", "BLOCK_V": "constexpr"}
        for kernel, sig, name in ((stats_kernel(), stats_sig, "COMPUTE_ENTROPY"),
                                  (grad_kernel(), grad_sig, "HAS_ENTROPY_GRAD")):
            src = ASTSource(kernel, signature=sig, constexprs={name: flag, "BLOCK_V": 4096})
            out.append(triton.compile(src, target=target))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("capability", [80, 90], ids=["sm_80", "sm_90"])
def test_kernels_compile_to_cubin_without_gpu(monkeypatch, capability):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    compiled = _compile_all(capability)
    assert len(compiled) == 6
    for c in compiled:
        assert len(c.asm["cubin"]) > 0
        assert f".target sm_{capability}" in c.asm["ptx"]
