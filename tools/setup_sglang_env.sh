#!/usr/bin/env bash
# Build .venv-sglang: a CPU-only SGLang 0.5.23 environment for the `sglang`-marked tests.
#
# SGLang pins a CUDA torch and CUDA kernels; on a CPU machine we install torch 2.13.0 (CPU), sglang and
# sglang-router with --no-deps, then the non-CUDA part of sglang's requirements by hand, and put an
# import-only stand-in for `sgl_kernel` on the venv's path (see /work/shared/notes/sglang-on-cpu.md).
# Usage: bash tools/setup_sglang_env.sh [VENV_DIR=.venv-sglang] [TORCH_WHEEL_OR_SPEC]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-sglang}"
TORCH="${2:-}"
if [[ -z "$TORCH" ]]; then
  TORCH="$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1 || true)"
  # Fallback when no wheel is on disk: the CPU build from the PyTorch CPU index is not reachable here,
  # so plain PyPI's torch==2.13.0 is used (a larger CUDA-enabled build that still runs on CPU).
  TORCH="${TORCH:-torch==2.13.0}"
fi
PYTHON="${PYTHON:-python3}"
start=$(date +%s)
SMOKE="import sglang.srt.entrypoints.http_server, sglang_router; print('sglang', __import__('sglang').__version__, 'ok')"

# Already built (a CI machine that kept it): only re-check that it still imports.
if [[ -f "$VENV/.installed" ]] && SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "$SMOKE"; then
  echo "setup_sglang_env: $VENV already set up"
  exit 0
fi

"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "$TORCH"
"${PIP[@]}" --no-deps sglang==0.5.23 sglang-router==0.3.2

# sglang 0.5.23's Requires-Dist minus everything CUDA-only (cuda-python, flashinfer, flash-attn-4,
# sglang-kernel, sgl-*, nvidia-*, quack/humming/tilelang kernels, torch_memory_saver) and minus
# torchvision/torchaudio/torchcodec/timm: PyPI's torchvision is a CUDA build that breaks at import
# ('operator torchvision::nms does not exist') and takes transformers' Qwen2 import down with it.
DEPS=(
  aiohttp "anthropic>=0.20.0" blobfile==3.0.0 build compressed-tensors==0.18.0 datasets distro easydict
  einops fastapi gguf interegular IPython "llguidance>=1.7.6,<2.0.0" "mistral_common>=1.11.5" msgspec
  ninja numba==0.65.1 numpy openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11 packaging
  partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64 pydantic "python-dateutil<3"
  python-multipart "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 setproctitle
  soundfile==0.13.1 tiktoken tokenizers==0.23.2 tqdm transformers==5.19.0 "uvicorn>=0.51" uvloop
  watchfiles xgrammar==0.2.7 xxhash zstandard httpx==0.29.0 safetensors pytest
)
"${PIP[@]}" "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')" "${DEPS[@]}"
# Never let a dependency replace the CPU torch with a CUDA one.
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"torch was replaced: {torch.__version__}"
PY

# SGLang imports torchvision (multimodal configs) at server start. PyPI's torchvision is built against
# CUDA torch: installed --no-deps, its C++ ops fail to load and the guard below makes the import survive.
"${PIP[@]}" --no-deps torchvision==0.28.0

# The sgl_kernel stand-in and the torchvision guard: a .pth file puts tools/sgl_kernel_stub on sys.path of
# this venv only and installs the guard's import hook.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\nimport megatron_dapo_cpu_guard\n' "$(pwd)/tools/sgl_kernel_stub" > "$SITE/megatron_dapo_sgl_kernel_stub.pth"
"$VENV/bin/python" -m pip install -q --no-deps -e .

# Smoke test: fails loudly (non-zero exit) if an import needs something the stand-in lacks.
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "$SMOKE"
touch "$VENV/.installed"
echo "setup_sglang_env: $VENV ready in $(( $(date +%s) - start )) s"
