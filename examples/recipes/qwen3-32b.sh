# DAPO's 32B setting (examples/recipes/qwen2.5-32b.sh: TP 8 x PP 2 with sequence parallelism and block recompute of
# 16 of each stage's 32 layers, SGLang servers on the rollout nodes) with Qwen3-32B's model file.
# Memory (--dry-run --world-size 64): stage 0, two 24k-token micro-batches in flight, at ~56 GiB of 80 (30% headroom).
MODEL=qwen3-32B
RUN_DIR=${RUN_DIR:-runs/qwen3-32b-dapo}
source examples/recipes/qwen2.5-32b.sh
