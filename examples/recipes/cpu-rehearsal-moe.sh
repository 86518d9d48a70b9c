# The CPU rehearsal's MoE variant (tests/slurm/test_slurm_rehearsal.py): examples/recipes/qwen3-30b-a3b.sh's code path at a
# size two CPU cores run, submitted with examples/slurm/split.sbatch: one actor node of 2 gloo ranks with the experts
# split over them (EP 2 x DP 2) on a tiny all-MoE Qwen3-MoE (HF_CKPT: 8 experts top-2, made by the test), one
# rollout node with one real CPU SGLang server (no router), distributed weight sync of every expert's HF tensors.
# Otherwise examples/recipes/cpu-rehearsal.sh.
ACTOR_NODES=${ACTOR_NODES:-1}
RANKS_PER_NODE=${RANKS_PER_NODE:-2}
ACTOR_TP=1
ACTOR_PP=1
NUM_STEPS=${NUM_STEPS:-2}
RUN_DIR=${RUN_DIR:-runs/cpu-rehearsal-moe}
source examples/recipes/cpu-rehearsal.sh
SERVERS_PER_NODE=1
ROUTER=0
PARALLEL_ARGS+=(--expert-model-parallel-size 2)
