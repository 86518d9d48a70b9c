#!/usr/bin/env bash
# The first check on a GPU machine, in one command (under 9 minutes on one H200):
#   1. hf_logits  a tiny Qwen2 loaded from HF weights into the Megatron model vs transformers' logits (CUDA)
#   2. trainer    the embedded demo's DAPO loop, 3 steps on CUDA with NCCL (world size 1), vs the same seed on CPU
#   3. kernels    the Triton log-prob/entropy kernels at V=152064 (bf16, fp32) vs fp64; time and peak memory
#                 against the naive log_softmax + gather
#   4. scale      a random ~1.5B Qwen2 (Qwen2.5-1.5B shapes), 3 steps at 8k and 16k tokens per micro-batch,
#                 with and without recompute: max memory allocated, tokens/s, MFU
#   5. colocate   --colocate's phase switch with that actor next to a stand-in SGLang block: memory resident per
#                 phase, seconds per switch, training after offload/onload vs without
#   6. ipc        a tensor-mode weight bucket (IpcBucketPool) opened by a second process on the same GPU while the
#                 sender runs with expandable segments (the launchers' setting): bytes equal, segment not expandable
# Each part runs in its own process under its own time limit, so one failing part keeps the others' figures.
# Results: $OUT/gpu_smoke.json and $OUT/gpu_smoke.md (OUT defaults to runs/gpu_smoke); logs: $OUT/<part>.log.
#
# The GPU machine needs PyTorch with CUDA, Triton and transformers. megatron-core 0.16.1 (and einops / psutil
# when missing) come as wheels in .whl/ (tools/fetch_gpu_wheels.sh, run beforehand on a machine with
# internet) and are installed here with pip --no-index into .whl/site. TransformerEngine is not carried
# (its wheels are far over the 64 MiB limit): every part that builds a model passes --transformer-impl local
# where TE does not import (the trainer's own CUDA default requires TE) and says so in its `layers` line.
# Python, torch and transformers are the machine's own (the lent one: Python 3.12, torch 2.11, not the pins of
# requirements.txt); the versions that ran are printed first and recorded in every part's result.
#
# usage: bash tools/gpu_smoke.sh [--dry] [PART ...]
#   --dry   tiny sizes on CPU (gloo): checks this script's plumbing (tests/unit/tools/test_gpu_smoke.py), measures nothing
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=()
PARTS=()
for arg in "$@"; do
    case "$arg" in
        --dry) DRY=(--dry) ;;
        hf_logits|trainer|kernels|scale|colocate|ipc) PARTS+=("$arg") ;;
        *) echo "usage: bash tools/gpu_smoke.sh [--dry] [hf_logits|trainer|kernels|scale|colocate|ipc ...]" >&2; exit 2 ;;
    esac
done
[ ${#PARTS[@]} -eq 0 ] && PARTS=(hf_logits trainer kernels scale colocate ipc)
OUT_DIR=${OUT:-runs/gpu_smoke}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
# The launchers' settings (examples/*.sh): expandable segments, one CUDA connection.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

# Python: $PY, else this repo's .venv, else the first python3/python that imports torch.
if [ -z "${PY:-}" ]; then
    for candidate in .venv/bin/python python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
            PY=$candidate
            break
        fi
    done
fi
[ -n "${PY:-}" ] || { echo "gpu_smoke: no python with torch found (set PY=...)" >&2; exit 2; }

# megatron-core & co. from the carried wheels, only when missing (never from the network).
missing=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(pkg for mod, pkg in (("megatron.core", "megatron-core==0.16.1"), ("einops", "einops"),
                                    ("psutil", "psutil")) if importlib.util.find_spec(mod.split(".")[0]) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "== installing from .whl/: $missing"
    # --target implies --ignore-installed, so no dependency resolution: megatron-core's own needs (torch,
    # numpy, packaging) are already on the machine.
    # shellcheck disable=SC2086
    timeout 30 "$PY" -m pip install -q --no-index --no-deps --find-links .whl --target .whl/site $missing \
        || { echo "gpu_smoke: installing $missing from .whl/ failed (run tools/fetch_gpu_wheels.sh first)" >&2; exit 2; }
fi
[ -d .whl/site ] && export PYTHONPATH="$PWD/.whl/site:$PYTHONPATH"
"$PY" - <<'EOF'
import platform
from importlib import metadata, util
import torch
te = "imports" if util.find_spec("transformer_engine") else "absent: local layers"
versions = []
for dist in ("megatron-core", "transformers", "triton"):
    try:
        versions.append(f"{dist} {metadata.version(dist)}")
    except metadata.PackageNotFoundError:
        versions.append(f"{dist} absent")
print(f"== python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}), {', '.join(versions)}; transformer_engine {te}")
EOF

# Per-part limits (s): the sum is 9 minutes; the parts usually end well before their limits.
declare -A LIMIT=([hf_logits]=60 [trainer]=150 [kernels]=90 [scale]=150 [colocate]=60 [ipc]=30)
[ ${#DRY[@]} -gt 0 ] && LIMIT=([hf_logits]=300 [trainer]=300 [kernels]=300 [scale]=300 [colocate]=300 [ipc]=300)
for part in "${PARTS[@]}"; do
    rm -f "$OUT_DIR/$part.json" "$OUT_DIR/$part.rc"
    echo "== $part (limit ${LIMIT[$part]} s)"
    start=$SECONDS
    timeout -k 10 "${LIMIT[$part]}" "$PY" tools/gpu_smoke.py "$part" --out "$OUT_DIR" "${DRY[@]}" \
        >"$OUT_DIR/$part.log" 2>&1
    rc=$?
    echo "$rc" >"$OUT_DIR/$part.rc"
    echo "   exit $rc after $((SECONDS - start)) s (log: $OUT_DIR/$part.log)"
done
"$PY" tools/gpu_smoke.py report --out "$OUT_DIR" "${DRY[@]}"
