# The CPU rehearsal's colocated variant: examples/recipes/qwen2.5-32b-colocated.sh's code path at a size two CPU
# cores run, submitted with examples/slurm/colocated.sbatch: every node runs one real CPU SGLang engine at TP 2 and 2
# gloo actor ranks (TP 2 x DP 2 over 2 nodes), each rank handing its weights to the engine rank of its index on its
# own node (--colocate: tensor mode, shared memory on CPU). SGLang's CPU backend answers release/resume but frees
# nothing (tests/sglang/test_colocate_dist.py), so this rehearses the launch and the protocol, not the memory.
# Otherwise examples/recipes/cpu-rehearsal.sh.
ACTOR_NODES=${NODES:-2}
RANKS_PER_NODE=2
ACTOR_TP=2
ACTOR_PP=1
RUN_DIR=${RUN_DIR:-runs/cpu-rehearsal-colocated}
source examples/recipes/cpu-rehearsal.sh
MODE=colocated
SGLANG_TP=2
SERVERS_PER_NODE=1
export SGLANG_CPU_OMP_THREADS_BIND=${SGLANG_CPU_OMP_THREADS_BIND:-0|1}  # SGLang's CPU backend: one core per TP rank
ROLLOUT_ARGS+=(--colocate --rollout-num-gpus-per-engine 2)
