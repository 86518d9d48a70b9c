"""Megatron-style command-line flags of `python -m megatron_dapo.train`, grouped by component.

One function per --help group (FLAG_GROUPS), its docstring naming the configs its flags fill (startup.py builds
them, once); choices come from the registries and constants that own them. Flag names follow Megatron-LM where one
exists (--tensor-model-parallel-size, --lr, --clip-grad, --save-interval, ...) and slime / verl's DAPO recipe for
the RL ones (--n-samples-per-prompt, --rollout-batch-size, --clip-ratio-high, --overlong-buffer-length, ...). Values
are validated by the config dataclasses they fill, whose errors name the flag.
"""

from __future__ import annotations

import argparse

from megatron_dapo.actor.config import LR_DECAY_STYLES, PARAMS_DTYPES
from megatron_dapo.algorithm import AGG_MODES, ON_EXHAUSTED
from megatron_dapo.algorithm.kl import KL_ESTIMATORS
from megatron_dapo.algorithm.mismatch import MIS_MODES
from megatron_dapo.algorithm.registry import advantage_estimator_help, policy_loss_help
from megatron_dapo.data.length import CHARS_PER_TOKEN_BOUND, ON_LONG_PROMPT
from megatron_dapo.data.prompt_set import PROMPT_FORMATS
from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.flag_field import argparse_spec, flag_fields
from megatron_dapo.reward.registry import BUILTIN_REWARD_FNS
from megatron_dapo.rollout import ENGINE_KINDS
from megatron_dapo.rollout.async_rollout import ASYNC_ROLLOUT_DEPTHS
from megatron_dapo.rollout.multi_turn import SCHEDULES as TOOL_SCHEDULES
from megatron_dapo.rollout.stream import STALE_POLICIES
from megatron_dapo.tool_use.templates import tool_template_help
from megatron_dapo.weight_sync.transports import transport_names


class DeprecatedAlias(argparse.Action):
    """A store_true flag kept under an old name: sets `dest` and warns once, naming the new flag."""

    def __init__(self, option_strings, dest, target: str, **kwargs):
        self.target = target
        kwargs.setdefault("default", False)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import warnings

        warnings.warn(f"{option_string} is deprecated: use {self.target} (the same setting)", FutureWarning,
                      stacklevel=2)
        setattr(namespace, self.dest, True)


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """The "model and checkpoints" group: InputsConfig (the model, the tokenizer), CheckpointConfig, the
    TrainerConfig's save cadence and exit bound."""
    g = p.add_argument_group("model and checkpoints")
    g.add_argument("--hf-checkpoint", required=True,
                   help="HF model directory (config.json, safetensors, tokenizer) of a registered model family "
                        "(docs/MODELS.md): the initial policy and the architecture")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --hf-checkpoint)")
    g.add_argument("--mcore-checkpoint", default=None,
                   help="deprecated: pass `checkpoint_convert hf-to-mcore` output as --load instead")
    g.add_argument("--load", default=None,
                   help="resume from this checkpoint directory (written by --save; the newest step is taken), "
                        "or start from `checkpoint_convert hf-to-mcore` output (torch_dist, any TP/PP; model "
                        "weights only, iteration 0); one without a checkpoint is an error, except --load = --save "
                        "before the first save (starts at step 0)")
    g.add_argument("--save", default=None, help="checkpoint directory (model, optimizer, scheduler, RNG, "
                                                "sampler, step); locked while the run lasts. One that holds another "
                                                "run's steps is refused unless --load names it too (resume) or "
                                                "--overwrite-save is given")
    g.add_argument("--overwrite-save", action="store_true",
                   help="start this run's checkpoints in a --save that holds another run's steps: they are deleted "
                        "(with `latest`) once the inputs are read, before the model is built; one line names them")
    g.add_argument("--export-hf", default=None,
                   help="at the end, write the trained policy here as an HF checkpoint (safetensors, config, "
                        "tokenizer); with --load of a finished run and the same --num-steps it only exports")
    g.add_argument("--save-interval", type=int, default=0,
                   help="checkpoint every N steps (0 = only at the end)")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true",
                   help="split the writing of replicated checkpoint tensors over the data-parallel ranks "
                        "(megatron-core FullyParallelSaveStrategyWrapper) instead of DP rank 0 writing them all")
    g.add_argument("--exit-save-timeout-s", type=float, default=25.0, metavar="SECONDS",
                   help="on SIGTERM (Slurm: time limit, preemption, scancel) or a first SIGINT: stop at the next safe "
                        "point (an unfinished rollout is abandoned, an update finished), save the last finished step "
                        "unless it is saved, and exit with 128 + the signal, all within this many seconds of the "
                        "signal; a save that would not fit (judged by this run's slowest save) is skipped, and at the "
                        "bound the process exits whatever it does, removing an unfinished step_N.tmp: the previous "
                        "checkpoint stays. Keep it under Slurm's KillWait and torchrun's --shutdown-timeout (30 s "
                        "each by default); 0 exits at once. A second SIGINT exits at once. docs/FAULT_TOLERANCE.md")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in a forked background process; a step is renamed (and `latest` "
                        "updated) only once every rank's write finished, checked at the next save and at exit")


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    """The "parallelism" group: ParallelLayout (distributed/parallel.py), the actor's distributed optimizer and the
    --dry-run planner's own flags (planner/report.py)."""
    g = p.add_argument_group("parallelism")
    for f in flag_fields(ParallelLayout):  # declared beside their fields: --tensor-model-parallel-size, ...
        name, kwargs = argparse_spec(f)
        g.add_argument(name, **kwargs)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over data-parallel ranks (megatron-core distributed "
                        "optimizer)")
    g.add_argument("--dry-run", action="store_true",
                   help="build no model: print the per-GPU memory plan of these flags (megatron_dapo.planner, "
                        "reads only --hf-checkpoint's config.json) and exit 1 when it exceeds --gpu-memory-gib")
    g.add_argument("--gpu-memory-gib", type=float, default=80.0,
                   help="GiB of one GPU (finite, > 0): the --dry-run plan must fit it, a --colocate run sizes "
                        "SGLang's share from it")
    g.add_argument("--world-size", type=int, default=None,
                   help="actor GPUs for --dry-run, >= 1 (default: $WORLD_SIZE, else TP x PP x CP)")


def _moe_flags(p: argparse.ArgumentParser) -> None:
    """The "mixture of experts" group: the ActorConfig's MoE fields (ActorConfig.check_model refuses them on a dense
    model)."""
    g = p.add_argument_group("mixture of experts", "mixture-of-experts models only: each is refused for a model "
                                                   "without experts")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                   help="megatron-core's load-balancing (Switch) loss coefficient per MoE layer; default: "
                        "config.json router_aux_loss_coef; 0 turns it off (docs/MODELS.md: how it relates to HF's)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="tokens an expert takes per step, as a multiple of the even share; the rest are dropped "
                        "(logged as moe/dropped_tokens); default: none dropped (dropless)")
    g.add_argument("--moe-routing-replay", action="store_true",
                   help="train on the experts the rollout engine routed each token to (SGLang's "
                        "--enable-return-routed-experts; arXiv 2510.11370) instead of re-routing")


def _optimizer_flags(p: argparse.ArgumentParser) -> None:
    """The "optimizer" group: the ActorConfig's optimizer and LR schedule; the run's seed."""
    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-steps", type=int, default=0,
                   help="linear warmup in ROLLOUT steps (not optimizer steps): every optimizer step of rollout "
                        "step k trains at lr*k/W for k <= W (DAPO: 20)")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="constant",
                   help="LR after warmup, as a function of the rollout step (DAPO: constant)")
    g.add_argument("--lr-decay-steps", type=int, default=None,
                   help="rollout step at which a decaying LR reaches --min-lr (default: --num-steps)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip (0 = off)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)


def _batching_flags(p: argparse.ArgumentParser) -> None:
    """The "batching" group: TrainerConfig (steps, updates per step), the ActorConfig's micro-batching and log-prob
    kernels, the context check."""
    g = p.add_argument_group("batching")
    g.add_argument("--num-steps", "--num-rollout", dest="num_steps", type=int, required=True,
                   help="training steps (one rollout batch each)")
    g.add_argument("--rollout-batch-size", type=int, default=512, help="prompt groups kept per step")
    g.add_argument("--n-samples-per-prompt", type=int, default=16, help="G, responses per prompt")
    g.add_argument("--global-batch-size", type=int, default=0,
                   help="responses per optimizer step (DAPO: 32 prompts x 16 = 512); 0 = the whole "
                        "rollout batch (one update per step)")
    g.add_argument("--max-tokens-per-micro-batch", type=int, default=8192,
                   help="token budget of one padded micro-batch, rows x longest row (dynamic batch size)")
    g.add_argument("--use-fused-logprob", action=argparse.BooleanOptionalAction, default=True,
                   help="fused vocab-parallel log-prob/entropy kernel (megatron_dapo.ops) in the loss")
    g.add_argument("--pack-sequences", action=argparse.BooleanOptionalAction, default=False,
                   help="pack each micro-batch's rows into one [1, T] row: --max-tokens-per-micro-batch then "
                        "counts real tokens (padding waste ~0). On GPU it needs --transformer-impl "
                        "transformer_engine (THD attention over cu_seqlens); the local spec (CPU) uses a "
                        "block-diagonal causal [T, T] mask, which costs more than padding there. The GPU "
                        "launchers turn it on")
    g.add_argument("--fused-linear-logprob", action=argparse.BooleanOptionalAction, default=False,
                   help="log-probs/entropy straight from the last stage's hidden states and output weight "
                        "(megatron_dapo.ops.fused_linear_logprob_entropy), chunk by chunk: no [tokens x V/tp] "
                        "logits (32B launcher: 1.75 -> 0.66 GiB per micro-batch on the last stage). Recomputes "
                        "the output GEMM in backward; the GPU launchers turn it on")
    g.add_argument("--params-dtype", choices=list(PARAMS_DTYPES), default=None,
                   help="actor parameter dtype (bf16 keeps fp32 main params); default: bf16 on GPU, "
                        "fp32 on CPU")
    g.add_argument("--allow-exceed-context", action="store_true",
                   help="run even when --max-prompt-length + --max-response-length exceeds the model's "
                        "max_position_embeddings (positions past the trained context)")


def _rollout_flags(p: argparse.ArgumentParser) -> None:
    """The "rollout" group: CollectConfig's sampling, then rank 0's RolloutEngineConfig (rollout/build.py): the SGLang
    servers, their client, the weight-sync transport."""
    g = p.add_argument_group("rollout")
    _sampling_flags(g)
    _sglang_server_flags(g)
    _sglang_client_flags(g)
    _weight_sync_flags(g)


def _sampling_flags(g: argparse._ArgumentGroup) -> None:
    """The rollout's sampling and batches (CollectConfig), the engine kind, async and partial rollouts."""
    g.add_argument("--rollout-engine", choices=ENGINE_KINDS, default=None,
                   help="default: sglang when CUDA is available, else the embedded CPU engine")
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--max-response-length", type=int, default=20480, help="L_max, new tokens per response")
    g.add_argument("--max-prompt-length", type=int, default=2048,
                   help="prompt tokens after the chat template; longer prompts are skipped at load (--on-long-prompt)")
    g.add_argument("--over-sample-factor", type=float, default=1.0,
                   help="prompts asked per generation round = factor x groups still needed / keep rate "
                        "measured so far in the step (1 in the first round)")
    g.add_argument("--partial-rollout", action=argparse.BooleanOptionalAction, default=False,
                   help="groups still generating (or finished behind the cut) when a step's batch is full keep "
                        "their responses so far and resume first at the next step, instead of being thrown away; "
                        "prefix tokens come from older weights (pair with --use-tis); "
                        "megatron_dapo/rollout/partial_rollout.py")
    g.add_argument("--partial-rollout-max-staleness", type=int, default=None, metavar="N",
                   help="with --partial-rollout: a carried group whose oldest token is more than N weight versions "
                        "behind the engine at the step that would resume it is dropped instead (tokens counted in "
                        "rollout/discarded_tokens, groups in rollout/stale_dropped_groups), so rollout/max_staleness "
                        "<= N; >= 1, default 1 (drops nothing while carried groups are resumed at the next step)")
    g.add_argument("--async-rollout", type=int, choices=ASYNC_ROLLOUT_DEPTHS, default=0,
                   help="one-step-off-policy: 1 = global rank 0 generates step k+1's batch (engine on the weights "
                        "before step k) while every rank trains step k; the weight push after step k waits for "
                        "that batch. Turns --use-tis on unless --no-use-tis is given. On CPU the embedded engine "
                        "runs in its own process. 0 = synchronous (megatron_dapo/rollout/async_rollout.py)")
    g.add_argument("--max-staleness", type=int, default=0, metavar="K",
                   help="fully asynchronous rollout: global rank 0 generates continuously, hands each step's batch "
                        "over the moment its groups exist, and every trained token is at most K weight versions "
                        "behind the actor (K >= 1; groups over the bound: --stale-policy). The push lands at a cut "
                        "(requests in flight continue after it on the new weights). Excludes --async-rollout, "
                        "--partial-rollout and --colocate; K >= 2 needs an off-policy correction (--use-tis, "
                        "--mis-mode or --policy-loss decoupled) unless --allow-uncorrected-staleness. 0 = off "
                        "(megatron_dapo/rollout/streaming.py)")
    g.add_argument("--stale-policy", choices=STALE_POLICIES, default="drop",
                   help="with --max-staleness: a group with a token more than K versions old when it is decided is "
                        "dropped (rollout/stale_dropped_groups), or its stale samples are generated again on the "
                        "current weights (rollout/regenerated_tokens)")
    g.add_argument("--max-in-flight-groups", type=int, default=0, metavar="N",
                   help="with --max-staleness: at most N groups submitted and not yet decided. 0 (default) = 1.25x "
                        "what the engine generates at once, in groups (embedded: --rollout-batch-size; SGLang: "
                        "--sglang-max-concurrency / --n-samples-per-prompt): groups queued beyond it would start "
                        "late and cross more pushes (docs/BENCHMARKS.md)")
    g.add_argument("--rollout-timeout", type=float, default=12.0,
                   help="HOURS the other ranks wait for global rank 0's rollout or evaluation (a gloo group "
                        "made at start; Megatron's NCCL groups keep their own 30-minute timeout); a failure of "
                        "that work on rank 0 makes them raise at once")


def _sglang_server_flags(g: argparse._ArgumentGroup) -> None:
    """The SGLang servers: launched (GPUs, flags, colocation, memory) or attached by URL."""
    g.add_argument("--sglang-num-servers", type=int, default=1)
    g.add_argument("--sglang-tp-size", "--rollout-num-gpus-per-engine", dest="sglang_tp_size", type=int, default=1,
                   help="tensor parallel size (= GPUs) of each SGLang server; --rollout-num-gpus-per-engine is the "
                        "same flag under slime's name")
    g.add_argument("--sglang-base-port", type=int, default=30000)
    g.add_argument("--sglang-host", default="127.0.0.1")
    g.add_argument("--sglang-extra-args", default="", help="extra flags passed to sglang.launch_server")
    g.add_argument("--sglang-python", default=None,
                   help="python that runs sglang.launch_server (default: this one; on CPU: .venv-sglang/bin/python "
                        "from `make sglang-env`)")
    g.add_argument("--sglang-gpus", default=None,
                   help="CUDA_VISIBLE_DEVICES of the launched servers, e.g. 4,5,6,7 (apart from the "
                        "actor's GPUs); on CUDA, launched servers need this or --colocate")
    g.add_argument("--colocate", action="store_true",
                   help="hybrid mode: the SGLang engines run on the actor's own GPUs (engine i on GPUs i x "
                        "--rollout-num-gpus-per-engine ...) and the two take turns every step: SGLang releases its "
                        "weights and KV cache for training, the actor offloads grads and optimizer state for "
                        "generation (megatron_dapo/trainer/colocate.py); --dry-run plans both phases")
    g.add_argument("--sglang-colocate", action=DeprecatedAlias, dest="colocate", nargs=0, target="--colocate",
                   help="deprecated alias of --colocate (warns)")
    g.add_argument("--mem-fraction-static", type=float, default=None,
                   help="SGLang's static pool (weights + KV cache) as a fraction of GPU memory, given to launched "
                        "servers; default with --colocate: computed by the --dry-run planner so that the "
                        "generation phase fits --gpu-memory-gib, else SGLang's own default")
    g.add_argument("--sglang-deterministic-inference", action=argparse.BooleanOptionalAction, default=True,
                   help="launch the CUDA servers of a seeded run in SGLang's deterministic inference mode, "
                        "without which SGLang ignores the per-request seeds (costs decoding speed); attached "
                        "servers are asked through /server_info and a warning is printed when it is off")
    g.add_argument("--sglang-server-urls", nargs="+", default=None,
                   help="attach to running SGLang servers instead of launching them (multi-node rollouts)")
    g.add_argument("--sglang-router-url", default=None,
                   help="attach mode: an sglang-router already running in front of the --sglang-server-urls "
                        "servers; generation goes through it while every server serves, weight sync, aborts "
                        "and retries go to each server directly")
    g.add_argument("--sglang-max-concurrency", type=int, default=256,
                   help="requests in flight; rank 0 raises its open-file limit to match (rollout/sglang/fd_limit.py)")


def _sglang_client_flags(g: argparse._ArgumentGroup) -> None:
    """Rank 0's client of the servers: the API key and the timeouts (ClientConfig)."""
    g.add_argument("--sglang-api-key", default=None,
                   help="API key of the SGLang servers (default: $SGLANG_API_KEY): given to launched servers (SGLang's "
                        "api_key) and sent on every call; required to launch on a non-loopback --sglang-host. "
                        "Visible to every user of the node in ps: prefer --sglang-api-key-file or SGLANG_API_KEY")
    g.add_argument("--sglang-api-key-file", default=None,
                   help="file holding the SGLang API key (instead of --sglang-api-key, which ps shows): read once, "
                        "surrounding whitespace stripped; must be readable by its owner only (chmod 600) and exist "
                        "on every node of the run")
    g.add_argument("--sglang-allow-no-api-key", action="store_true",
                   help="launch on a non-loopback --sglang-host without an API key (anyone reaching the port can "
                        "run code in the server through its pickle-based weight endpoints)")
    g.add_argument("--sglang-server-wait-s", type=float, default=600.0,
                   help="attach mode: how long a server that stopped answering (or is still starting when the run "
                        "attaches) may take to answer /health before the run stops with an error naming it")
    g.add_argument("--sglang-http-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long an SGLang server or router has to answer a health, info or short control call "
                        "(abort, pause, cache flush), and to accept any connection; one that does not counts as "
                        "lost: restarted (launched) or waited for (attached). At attach, a URL that does not answer "
                        "/health and /server_info as SGLang does is an error naming it and its answer. Weight "
                        "updates get 600 s. SGLang's own /health waits up to 20 s for a busy scheduler")
    g.add_argument("--sglang-min-tokens-per-s", type=float, default=10.0, metavar="RATE",
                   help="slowest decoding a /generate call is allowed: it times out after --sglang-http-timeout + "
                        "its max new tokens / RATE seconds and its server counts as lost (its samples are redone on "
                        "another). At --max-response-length 20480 and the defaults: 60 + 2048 s, ~35 min; lower it "
                        "when requests queue long on the servers (--sglang-max-concurrency far above what they batch)")


def _weight_sync_flags(g: argparse._ArgumentGroup) -> None:
    """The weight-sync transport to the servers (weight_sync/transports/)."""
    g.add_argument("--weight-sync-mode", choices=transport_names(), default=None,
                   help="tensor: colocated (CUDA IPC handles on GPU, shared memory on CPU); distributed: "
                        "separate GPUs (NCCL group with the servers); disk: safetensors + "
                        "update_weights_from_disk. Default: tensor for --colocate and on CPU, "
                        "distributed otherwise")
    g.add_argument("--weight-sync-bucket-mb", type=int, default=512,
                   help="flattened bucket size, in every --weight-sync-mode and with --colocate (slime's update "
                        "weight buffer size)")
    g.add_argument("--weight-sync-master-addr", default="127.0.0.1",
                   help="address of global rank 0 as the servers see it (distributed mode); at PP > 1 the other "
                        "stages' source ranks use MEGATRON_DAPO_WEIGHT_SYNC_ADDR set on their node, else this "
                        "address on rank 0's host, else their address on the route to this one, then their "
                        "hostname's, whichever is not loopback (weight_sync/stage_sync.py)")
    g.add_argument("--weight-sync-master-port", type=int, default=29650)


def _tool_flags(p: argparse.ArgumentParser) -> None:
    """The "tool use" group: rank 0's ToolUseConfig (rollout/multi_turn.py), its sandbox's SandboxLimits
    (tool_use/sandbox.py)."""
    g = p.add_argument_group("tool use (multi-turn rollouts with a Python interpreter)",
                             "off unless --tool-template is given; docs/TOOL_USE.md")
    g.add_argument("--tool-template", default=None, metavar="NAME",
                   help="the tool-call format the policy writes: " + tool_template_help() + ". Each sample becomes "
                        "a conversation: generate until a call ends, run its code in the sandbox, append the output "
                        "(masked out of the loss), continue; --max-response-length bounds the whole response, the "
                        "tool's tokens included")
    g.add_argument("--max-turns", type=int, default=4,
                   help="assistant turns per conversation; a call made at the last one is not run")
    g.add_argument("--tool-output-max-chars", type=int, default=1024,
                   help="characters of a tool's output the policy reads; the rest is cut with a marker")
    g.add_argument("--tool-schedule", choices=TOOL_SCHEDULES, default="continuous",
                   help="continuous: a conversation goes back to the engine as soon as its tool returns (tools run "
                        "while other turns generate); rounds: every waiting turn in one batch, then that round's "
                        "calls at once (reproducible batches, each round waits for its slowest turn: 1.6x the "
                        "step at the production setting, docs/BENCHMARKS.md)")
    g.add_argument("--tool-workers", type=int, default=None,
                   help="programs run at once on global rank 0's host (default: its CPU count)")
    g.add_argument("--tool-cpu-s", type=int, default=5, help="CPU seconds a program may use")
    g.add_argument("--tool-timeout-s", type=float, default=10.0, help="wall seconds a program may run")
    g.add_argument("--tool-memory-mib", type=int, default=1024, help="address space a program may map, MiB")


def _dapo_flags(p: argparse.ArgumentParser) -> None:
    """The "DAPO" group: the ActorConfig's policy loss, CollectConfig's dynamic sampling and overlong shaping, the
    TrainerConfig's advantage estimator, the reward function."""
    g = p.add_argument_group("DAPO")
    g.add_argument("--clip-ratio-low", type=float, default=0.2, help="eps_low")
    g.add_argument("--clip-ratio-high", type=float, default=0.28, help="eps_high (Clip-Higher)")
    g.add_argument("--clip-ratio-c", type=float, default=None, help="dual-clip constant (off by default)")
    g.add_argument("--policy-loss", default="dapo", metavar="NAME|pkg.mod:fn", help=policy_loss_help())
    g.add_argument("--advantage-estimator", default="grpo", metavar="NAME|pkg.mod:fn", help=advantage_estimator_help())
    g.add_argument("--loss-agg-mode", choices=AGG_MODES, default=None,
                   help="aggregation of --policy-loss dapo: token-mean (DAPO's token-level loss, when unset), "
                        "seq-mean-token-mean or seq-mean-token-sum; the other losses fix their own and reject a "
                        "different one")
    g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=True,
                   help="drop groups whose accuracy is all 0 or all 1 and keep sampling")
    g.add_argument("--max-num-gen-batches", type=int, default=0,
                   help="generation rounds per step (0 = unlimited)")
    g.add_argument("--on-gen-exhausted", choices=ON_EXHAUSTED, default="error",
                   help="when --max-num-gen-batches rounds did not fill the batch: stop with an error, or train "
                        "on the groups kept so far")
    g.add_argument("--overlong-buffer-length", type=int, default=4096,
                   help="L_cache of the soft penalty, in tokens; at most --max-response-length")
    g.add_argument("--overlong-penalty-factor", type=float, default=1.0)
    g.add_argument("--overlong-filter", action="store_true", help="mask truncated responses out of the loss")
    g.add_argument("--reward-fn", default="math_dapo",
                   help=f"{' | '.join(BUILTIN_REWARD_FNS)} | dotted path 'pkg.mod:fn' with signature "
                        "fn(response: str, ground_truth: str) -> RewardResult(score, acc, pred)")


def _off_policy_flags(p: argparse.ArgumentParser) -> None:
    """The "off-policy correction" group: the TrainerConfig's OffPolicyConfig (algorithm/mismatch.py)."""
    g = p.add_argument_group("off-policy correction",
                             "rollout (SGLang) vs actor log-probs, r = pi_old / pi_rollout per token; "
                             "see megatron_dapo/algorithm/mismatch.py")
    g.add_argument("--use-tis", action=argparse.BooleanOptionalAction, default=None,
                   help="truncated importance sampling: multiply each token's loss by min(r, --tis-cap); "
                        "default: on with --async-rollout 1 or --max-staleness, off otherwise")
    g.add_argument("--tis-cap", type=float, default=2.0, help="C of TIS, >= 1")
    g.add_argument("--mis-mode", choices=MIS_MODES, default=None,
                   help="masked importance sampling: drop tokens (token) or whole responses (sequence: geometric "
                        "mean of r) whose ratio is outside [1/--mis-threshold, --mis-threshold]; unset = off")
    g.add_argument("--mis-threshold", type=float, default=2.0, help="T of MIS, > 1")
    g.add_argument("--use-icepop", action="store_true",
                   help="IcePop (Ring-1T, arXiv 2510.18855): weight each token's loss by r inside [--icepop-low, "
                        "--icepop-high] and by 0 outside (both sides; the denominator keeps the token). Excludes "
                        "--use-tis, which it turns off by default")
    g.add_argument("--icepop-low", type=float, default=0.5, help="alpha of IcePop, in (0, 1)")
    g.add_argument("--icepop-high", type=float, default=5.0, help="beta of IcePop, > 1")
    g.add_argument("--allow-uncorrected-staleness", action="store_true",
                   help="train with --max-staleness K >= 2 and no off-policy correction (--no-use-tis, no "
                        "--use-icepop, no --mis-mode, a loss that does not weight by pi_old / pi_rollout): the "
                        "tokens K versions old are then trained as if on-policy")
    g.add_argument("--behav-weight-cap", type=float, default=None,
                   help="with --policy-loss decoupled (AReaL's decoupled PPO, weight r per token): tokens whose r "
                        "exceeds this cap (> 1) get weight 0; unset = uncapped, the paper's objective. Excludes "
                        "--use-tis")


def _reference_flags(p: argparse.ArgumentParser) -> None:
    """The "reference and teacher models" group: the frozen reference and teacher (CheckpointConfig.ref_load,
    teacher_load; actor/reference.py), the ActorConfig's KLConfig (algorithm/kl.py) and the TrainerConfig's
    DistillConfig (algorithm/distill.py)."""
    g = p.add_argument_group("reference and teacher models (KL, distillation)",
                             "frozen models on the actor's layout: the KL term to a reference, on-policy distillation "
                             "from a teacher; see megatron_dapo/algorithm/kl.py and distill.py")
    g.add_argument("--ref-load", default=None, metavar="initial|DIR",
                   help="the frozen reference model: 'initial' (the weights this run started from: converter "
                        "output under --load, else --hf-checkpoint), an HF checkpoint directory or a torch_dist "
                        "checkpoint of the actor's architecture; its log-probs of every trained sample feed the KL "
                        "term and train/kl. Unset: no reference model")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="beta of the KL(pi_theta || pi_ref) loss term, >= 0 (GRPO's; 0 with --ref-load logs "
                        "train/kl only); aggregated like the policy loss (token-mean for dapo, per response for "
                        "grpo). With --kl-in-reward: beta of the reward penalty instead, > 0")
    g.add_argument("--kl-estimator", choices=KL_ESTIMATORS, default=None,
                   help="the per-token estimator: k1 = log ratio, k2 = half its square, k3 = GRPO's "
                        "exp(-d) + d - 1 (default k3)")
    g.add_argument("--kl-in-reward", action="store_true",
                   help="put the KL in the reward instead of the loss (verl's algorithm.use_kl_in_reward): each "
                        "response's reward becomes r - beta x sum_t k(log pi_old - log pi_ref) over its loss tokens "
                        "(beta = --kl-coef > 0, k = --kl-estimator, pi_old the pre-update policy, no gradient) and "
                        "the --advantage-estimator recomputes the advantages from it; no KL loss term (train/kl is "
                        "still logged), kl/reward_penalty logs the mean beta x KL per response. Needs --ref-load; "
                        "excludes --distill-only")
    g.add_argument("--teacher-load", default=None, metavar="initial|DIR",
                   help="on-policy distillation: a frozen teacher with the student's tokenizer (an HF directory of "
                        "any architecture that divides into the actor's layout, or as --ref-load) scores every "
                        "trained sample; each token's advantage gains --distill-coef x (log pi_teacher - log "
                        "pi_old). Unset: none")
    g.add_argument("--teacher-url", nargs="+", default=None, metavar="URL",
                   help="on-policy distillation with the teacher served apart: SGLang servers (or a router) serving a "
                        "model with the student's tokenizer (checked at start-up: every id and a probe text) score "
                        "every trained sample with a prefill-only /generate, once per data-parallel replica. "
                        "Excludes --teacher-load")
    g.add_argument("--teacher-api-key-file", default=None, metavar="FILE",
                   help="file holding the --teacher-url servers' API key (mode 0600, on every node); unset: none")
    g.add_argument("--teacher-max-concurrency", type=int, default=64, metavar="N",
                   help="scoring requests in flight from each data-parallel replica to the --teacher-url servers")
    g.add_argument("--distill-coef", type=float, default=0.0,
                   help="the weight of the teacher's per-token advantage (> 0 with --teacher-load or --teacher-url)")
    g.add_argument("--distill-only", action="store_true",
                   help="train on the teacher's advantage alone (the verifier's is set to 0; needs "
                        "--no-dynamic-sampling, whose filter reads the verifier's rewards)")


def _data_flags(p: argparse.ArgumentParser) -> None:
    """The "data" group: InputsConfig's prompt files and their limits."""
    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", required=True, help="training prompts: DAPO-format parquet or jsonl")
    g.add_argument("--eval-prompt-data", default=None, help="held-out prompts for avg@k (parquet or jsonl)")
    g.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="chat",
                   help="chat: apply the tokenizer's chat template to the prompt messages; raw: use the text")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="prompts with more message characters are skipped or rejected (--on-long-prompt) before "
                        "they are tokenized, so one huge row cannot exhaust memory in the tokenizer. Default: "
                        f"{CHARS_PER_TOKEN_BOUND} x --max-prompt-length ({CHARS_PER_TOKEN_BOUND * 2048:,} for 2048), "
                        "far above what text needs (3-5 characters per token), so in practice it only catches "
                        "prompts that could not fit in --max-prompt-length tokens anyway")
    g.add_argument("--on-long-prompt", choices=ON_LONG_PROMPT, default="skip",
                   help="a prompt over --max-prompt-chars or --max-prompt-length: skip it (counted and reported) "
                        "or stop at start-up with an error naming its file and row")


def _eval_flags(p: argparse.ArgumentParser) -> None:
    """The "evaluation" group: the TrainerConfig's evaluation cadence and sampling; InputsConfig's eval prompt
    limit."""
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-interval", type=int, default=0, help="evaluate every N steps (0 = off)")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=4, help="k of avg@k")
    g.add_argument("--eval-temperature", type=float, default=1.0, help="DAPO's AIME avg@32: 1.0")
    g.add_argument("--eval-top-p", type=float, default=1.0, help="DAPO's AIME avg@32: 0.7")
    g.add_argument("--eval-max-response-length", type=int, default=None,
                   help="new tokens per evaluation response (default: --max-response-length; DAPO: 20480)")
    g.add_argument("--eval-max-prompts", type=int, default=0,
                   help="evaluate on the first N prompts (0 = all)")


def _logging_flags(p: argparse.ArgumentParser) -> None:
    """The "logging" group: LogConfig; --debug is the entry point's own."""
    g = p.add_argument_group("logging")
    g.add_argument("--log-dir", default="runs/dapo", help="metrics.jsonl, wandb files and the PNG report")
    g.add_argument("--wandb-project", default=None, help="online wandb when WANDB_API_KEY is set too")
    g.add_argument("--wandb-run-name", default=None)
    g.add_argument("--no-wandb", action="store_true")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--debug", action="store_true",
                   help="show the traceback of input errors instead of the one-line 'error: ...' (exit status 2)")


FLAG_GROUPS = (_checkpoint_flags, _parallel_flags, _moe_flags, _optimizer_flags, _batching_flags, _rollout_flags,
               _tool_flags, _dapo_flags, _off_policy_flags, _reference_flags, _data_flags, _eval_flags, _logging_flags)
"""The --help groups, in their order; each adds one group of flags, named after the config it fills."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_dapo.train",
        description="DAPO (arXiv 2503.14476) on a Megatron-core actor with SGLang or embedded rollouts. "
                    "Launch with torchrun for TP/PP/DP; a single process works for small models.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for add in FLAG_GROUPS:
        add(p)
    return p
