"""Colocated mode (megatron_dapo/trainer/colocate.py): the actor's offload/onload is exact, the phase switch talks to
SGLang in the right order, the flag combinations fail with errors naming the flags."""

from __future__ import annotations

import contextlib
from contextlib import contextmanager

import pytest
import torch

from megatron_dapo.actor import MegatronActor
from megatron_dapo.trainer.colocate import ActorOffloader, PhaseSwitcher, check_colocate_flags, engine_of_rank
from tests.dist.actor_common import make_samples, single_process_world, world_actor


@pytest.fixture(scope="module")
def world():
    yield from single_process_world(hf_seed=7)


def _state(actor: MegatronActor) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for c in actor.chunks for n, p in c.named_parameters()}
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = opt.optimizer
        for i, st in enumerate(inner.state.values()):
            for k, v in st.items():
                out[f"s.{i}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def test_offload_then_onload_continues_training_bit_exactly(world):
    """Two optimizer steps with an offload/onload between them == two steps never offloaded, bit for bit
    (weights and Adam state), and while offloaded the grad buffer and Adam state hold no memory."""
    s1, s2 = make_samples(6, seed=11), make_samples(6, seed=12)
    ref = world_actor(world, max_tokens_per_micro_batch=64)
    ref.train_step(s1, rollout_step=1)
    ref_metrics = ref.train_step(s2, rollout_step=2)

    actor = world_actor(world, max_tokens_per_micro_batch=64)
    actor.train_step(s1, rollout_step=1)
    off = ActorOffloader(actor.chunks, actor.optimizer)
    before = _state(actor)
    metrics = off.offload()
    assert off.grad_bytes > 0 and off.state_bytes > 0
    params = sum(p.numel() for c in actor.chunks for p in c.parameters())
    assert off.state_bytes >= 2 * 4 * params  # exp_avg + exp_avg_sq in fp32 (+ step scalars)
    assert metrics["colocate/actor_offloaded_gib"] == pytest.approx((off.grad_bytes + off.state_bytes) / 2**30)
    assert all(h.tensor.untyped_storage().nbytes() == 0 for h in off._state + off._grads)
    assert all(p.untyped_storage().nbytes() > 0 for c in actor.chunks for p in c.parameters())  # weights stay
    off.onload()
    after = _state(actor)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    metrics = actor.train_step(s2, rollout_step=2)
    assert metrics["pg_loss"] == ref_metrics["pg_loss"] and metrics["grad_norm"] == ref_metrics["grad_norm"]
    got, want = _state(actor), _state(ref)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_the_frozen_models_weights_leave_while_generating_and_come_back_bit_exactly(world):
    """--ref-load / --teacher-load under --colocate: the offloader moves the frozen models' weights to host with the
    actor's state (their storages hold nothing while SGLang generates) and puts them back as they were: the frozen
    model's log-probs after the round trip equal those before, bit for bit; the actor's weights never move."""
    from megatron_dapo.actor import ActorConfig

    layout, hf, arch = world
    actor = world_actor(world, max_tokens_per_micro_batch=64)
    frozen = MegatronActor(arch, ActorConfig(lr=1e-3, max_tokens_per_micro_batch=64), layout, frozen=True)
    for p, q in zip(frozen.modules[0].parameters(), actor.modules[0].parameters(), strict=True):
        p.copy_(q.detach() + 0.01)  # weights of its own
    samples = make_samples(6, seed=13)
    before = frozen.compute_log_probs(samples)
    off = ActorOffloader(actor.chunks, actor.optimizer, frozen.modules)
    metrics = off.offload()
    params = [p for m in frozen.modules for p in m.parameters()]
    assert off.frozen_bytes == sum(p.numel() * p.element_size() for p in params)
    assert metrics["colocate/frozen_offloaded_gib"] == pytest.approx(off.frozen_bytes / 2**30)
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    assert all(p.untyped_storage().nbytes() > 0 for c in actor.chunks for p in c.parameters())
    off.onload()
    after = frozen.compute_log_probs(samples)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert "colocate/frozen_offloaded_gib" not in ActorOffloader(actor.chunks, actor.optimizer).offload()


class _Recorder:
    def __init__(self, log):
        self.log = log

    def release_memory_occupation(self, tags):
        self.log.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags):
        self.log.append(("resume", tuple(tags)))


class _FakeOffloader:
    def __init__(self, log):
        self.log = log

    def offload(self):
        self.log.append("offload")
        return {"colocate/offload_s": 0.0}

    def onload(self):
        self.log.append("onload")
        return {"colocate/onload_s": 0.0}


def _recording_section(log):
    """A section (Trainer.section's shape) that logs "|" for its barrier, or ("failed", what) when the body raised."""
    @contextmanager
    def section(what):
        try:
            yield
        except BaseException:
            log.append(("failed", what))
            raise
        log.append("|")
    return section


def test_phase_switch_order():
    """release before onload; offload, resume weights, push, then resume KV cache and CUDA graphs."""
    log: list = []
    sw = PhaseSwitcher(offloader=_FakeOffloader(log), engine=_Recorder(log), section=_recording_section(log))
    sw.start()
    m = sw.to_training()
    assert "colocate/to_training_s" in m
    m = sw.to_generation(lambda: log.append("push") or {"sync/seconds": 1.0})
    assert m["sync/seconds"] == 1.0 and "colocate/to_generation_s" in m
    assert log == ["offload", "|", ("release", ("weights", "kv_cache", "cuda_graph")), "|", "onload", "|",
                   "offload", "|", ("resume", ("weights",)), "|", "push", ("resume", ("kv_cache", "cuda_graph")),
                   "|"]
    with pytest.raises(RuntimeError, match="from phase 'generation'"):
        sw.to_generation()


class _FailingRelease(_Recorder):
    def release_memory_occupation(self, tags):
        raise RuntimeError("SGLang answered 500")


def test_a_failed_release_is_reported_at_the_barrier_and_nothing_onloads():
    """Rank 0's engine call fails: the barrier the other ranks wait in gets the failure (they raise there), the
    error propagates on rank 0, and the actor does not onload next to a server that may still hold its memory."""
    log: list = []
    sw = PhaseSwitcher(offloader=_FakeOffloader(log), engine=_FailingRelease(log), section=_recording_section(log))
    sw.start()
    with pytest.raises(RuntimeError, match="SGLang answered 500"):
        sw.to_training()
    assert log == ["offload", "|", ("failed", "while SGLang released its GPU memory")]
    assert sw.phase == "generation"


BASE = dict(colocate=True, world_size=16, gpus_per_node=8, gpus_per_engine=4, num_servers=1, server_urls=None,
            rollout_engine="sglang")


@pytest.mark.parametrize("change,flag", [  # the rollout flags' own checks: RolloutEngineConfig (tests/unit/rollout)
    (dict(rollout_engine="embedded"), "--rollout-engine"),
    (dict(gpus_per_engine=3, world_size=12, gpus_per_node=8, server_urls=["u"] * 4), "--rollout-num-gpus-per-engine"),
    (dict(gpus_per_engine=16), "--rollout-num-gpus-per-engine"),
    (dict(server_urls=["http://a:1"] * 3), "--sglang-server-urls"),
    (dict(num_servers=2), "--sglang-num-servers"),
])
def test_colocate_flag_errors_name_the_flag(change, flag):
    with pytest.raises(ValueError, match=flag):
        check_colocate_flags(**{**BASE, **change})


def test_colocate_flags_that_work():
    check_colocate_flags(**{**BASE, "server_urls": [f"http://n{i}:30000" for i in range(4)]})
    check_colocate_flags(**{**BASE, "world_size": 8, "gpus_per_node": None, "num_servers": 2})
    check_colocate_flags(**{**BASE, "colocate": False, "num_servers": 3})  # separate GPUs: no world to cover
    assert [engine_of_rank(r, 4) for r in (0, 3, 4, 15)] == [(0, 0), (0, 3), (1, 0), (3, 3)]


def test_sglang_colocate_is_a_deprecated_alias():
    from megatron_dapo.arguments import build_parser

    base = ["--hf-checkpoint", "x", "--prompt-data", "y", "--num-steps", "1"]
    with pytest.warns(FutureWarning, match="--colocate"):
        args = build_parser().parse_args(base + ["--sglang-colocate"])
    assert args.colocate is True
    args = build_parser().parse_args(base + ["--colocate", "--rollout-num-gpus-per-engine", "4"])
    assert args.colocate and args.sglang_tp_size == 4
    assert build_parser().parse_args(base).colocate is False


def test_engine_release_resume_and_push_against_the_fake_server(world):
    """SGLangEngine's release/resume and ColocatedPusher at world size 1 against tests/sglang/fake_server.py
    (no SGLang needed): generation is refused while released, the push needs the weights resumed and lands
    whole (begin, buckets, end, flush), and the engine's samples carry the pushed version."""
    from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
    from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
    from megatron_dapo.weight_sync.colocated_push import ColocatedPusher, make_engine_groups
    from tests.sglang.fake_server import serve

    server, state = serve()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    engine = SGLangEngine(server_urls=[url], client=ClientConfig(control_timeout_s=30))
    pusher = ColocatedPusher(make_engine_groups([url], 1), bucket_bytes=64)
    named = [("a", torch.arange(6.0)), ("b", torch.ones(2, 3) * 2), ("c", torch.full((20,), 3.0))]
    req = [RolloutRequest(prompt_ids=[1, 2], n=1, sampling=SamplingParams(max_new_tokens=2), request_id="r")]
    try:
        switch = PhaseSwitcher(offloader=_FakeOffloader([]), engine=engine)
        switch.start()
        switch.to_training()
        assert state.released == {"weights", "kv_cache", "cuda_graph"}
        with pytest.raises(RuntimeError, match="memory released"):
            engine.generate(req)
        with pytest.raises(RuntimeError, match="weights released"):
            pusher.push(named, version=1)
        assert not state.in_update  # the refused push still closed its update session
        metrics = switch.to_generation(lambda: pusher.push(named, version=3))
        engine.set_weight_version(3)
        assert state.released == set() and metrics["sync/gbytes"] == pytest.approx(32 * 4 / 1e9)
        assert state.weights == {"a": list(range(6)), "b": [[2.0] * 3] * 2, "c": [3.0] * 20}
        assert state.version == "3" and state.tensor_payloads == [1, 1]  # two buckets (64 B cap)
        (sample,) = engine.generate(req)[0]
        assert sample.weight_version == 3
        assert state.memory_calls[-2:] == [("resume", ["weights"]), ("resume", ["cuda_graph", "kv_cache"])]
    finally:
        engine.shutdown()
        server.shutdown()


def test_a_colocated_engine_lost_mid_run_stops_the_run_naming_it(world):
    """docs/FAULT_TOLERANCE.md's "a colocated engine is lost mid-run: the run stops with an error naming it": the
    engine's server, at weight version 3 pushed by the actor ranks (ColocatedSync), dies and comes back on its port
    with its launch weights; the next generation finds it serving another version, and ColocatedSync.recover,
    which has no copy to re-sync it from, stops the engine: that call and every later one raise an error naming the
    server's URL and the way out (--load), and no sample of the old weights is returned."""
    from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
    from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
    from megatron_dapo.weight_sync.colocated_push import ColocatedPusher, ColocatedSync, make_engine_groups
    from tests.sglang.fake_server import kill, serve

    server, state = serve()
    port = server.server_address[1]
    url = f"http://127.0.0.1:{port}"
    engine = SGLangEngine(server_urls=[url], client=ClientConfig(control_timeout_s=30))
    sync = ColocatedSync(ColocatedPusher(make_engine_groups([url], 1), bucket_bytes=64), engine)
    assert engine.weight_sync is sync
    req = [RolloutRequest(prompt_ids=[1, 2], n=1, sampling=SamplingParams(max_new_tokens=2), request_id="r")]
    try:
        engine.set_weight_version(3)
        kill(server, state)
        server, state = serve(port=port)  # its node restarted it: launch weights, version "default"
        for _ in range(2):
            with pytest.raises(RuntimeError, match=rf"{url} was lost in colocated mode at weight version 3: .* "
                                                   r"restart the run from its last checkpoint \(--load\)"):
                engine.generate(req)
    finally:
        engine.shutdown()
        kill(server, state)


def test_memory_server_args_for_launched_cuda_servers():
    """Launched CUDA servers get --mem-fraction-static (given, or the planner's with --colocate) and, colocated,
    --enable-memory-saver; CPU servers nothing."""
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.rollout.build import memory_server_args
    from megatron_dapo.startup import engine_config
    from tests.unit.planner.test_planner import REPO

    base = ["--hf-checkpoint", str(REPO / "examples/models/qwen2.5-32B"), "--prompt-data", "x", "--num-steps", "1",
            "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
            "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "block",
            "--recompute-num-layers", "16", "--max-tokens-per-micro-batch", "24576", "--pack-sequences",
            "--fused-linear-logprob", "--world-size", "128", "--rollout-num-gpus-per-engine", "4"]
    def parse(argv):  # the engine's config as start-up parses it (startup.engine_config)
        args = build_parser().parse_args(argv)
        return engine_config(args, ModelArch.from_hf(args.hf_checkpoint), api_key=None)

    assert memory_server_args(parse(base + ["--colocate"]), cuda=True) == \
        ("--mem-fraction-static", "0.77", "--enable-memory-saver")
    assert memory_server_args(parse(base + ["--colocate", "--mem-fraction-static", "0.7"]), cuda=True) == \
        ("--mem-fraction-static", "0.7", "--enable-memory-saver")
    assert memory_server_args(parse(base + ["--mem-fraction-static", "0.8"]), cuda=True) == \
        ("--mem-fraction-static", "0.8")
    assert memory_server_args(parse(base), cuda=True) == ()
    assert memory_server_args(parse(base + ["--colocate"]), cuda=False) == ()


# ---- start-up order (train.py) ----------------------------------------------------------------------------
class _Stop(Exception):
    """Ends the run where the first training step would begin."""


class _StartupEngine(_Recorder):
    def shutdown(self):
        self.log.append("shutdown")

    def attach_sync(self, sync):  # SGLangEngine's: the colocated sync it would call to recover a lost server
        self.weight_sync = sync


def _run_startup(world, tmp_path, monkeypatch, *, resume: bool, extra: tuple[str, ...] = (), run=None) -> list:
    """train.train(--colocate) in this process with the heavy parts faked, recording the start-up events: the
    engine coming up and its memory calls, the actor's build, the checkpoint load, the offload and the push.
    `run(trainer)`: stands in for Trainer.run, and train.train then goes on to its end (without: the run stops
    where its first step would begin); `extra`: more flags."""
    from types import SimpleNamespace

    from megatron_dapo import actor as actor_mod
    from megatron_dapo import train as train_mod
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.checkpoint import training as checkpoint
    from megatron_dapo.checkpoint.state import ShardedState
    from megatron_dapo.data import ResumableSampler
    from megatron_dapo.rollout import build as rollout_build
    from megatron_dapo.rollout.collect import Prompt
    from megatron_dapo.trainer import build
    from megatron_dapo.trainer.loop import Trainer

    layout, _, arch = world
    log: list = []
    tokenizer = SimpleNamespace(eos_token_id=1, decode=lambda ids, **kw: "")
    monkeypatch.setattr(build, "load_inputs", lambda *configs, **kw: build.Inputs(
        arch=arch, tokenizer=tokenizer, train_prompts=[Prompt(prompt_ids=[2, 3], ground_truth="1", index=0)]))
    monkeypatch.setattr(actor_mod, "init_parallel", lambda *a, **kw: layout)
    monkeypatch.setattr(rollout_build, "make_rollout_engine", lambda cfg, tok: log.append("engine up") or
                        _StartupEngine(log))
    monkeypatch.setattr(build, "build_actor", lambda *a: log.append("build actor") or
                        SimpleNamespace(chunks=[], optimizer=SimpleNamespace(), checkpoint_state=ShardedState()))
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda load, actor: log.append("load checkpoint") or
                        {"sampler": ResumableSampler(1, seed=7).state_dict(), "step": 1})
    monkeypatch.setattr(ActorOffloader, "offload", lambda self: log.append("offload") or {})
    monkeypatch.setattr(Trainer, "sync_weights", lambda self, v: log.append(("push", v)) or {})

    def first_step(self, step):
        log.append(("step", step))
        raise _Stop

    monkeypatch.setattr(Trainer, "rank0_batch", first_step)
    if run is not None:
        monkeypatch.setattr(Trainer, "run", run)
    monkeypatch.setattr(build, "export_hf", lambda actor, out, hf, step: log.append(("export", step)))
    # the fixture's one-rank process group outlives this run: train's own `dist` sees none to destroy
    monkeypatch.setattr(train_mod, "dist", SimpleNamespace(is_initialized=lambda: False, get_rank=lambda: 0))
    argv = ["--hf-checkpoint", "unused", "--prompt-data", "unused", "--num-steps", "2", "--colocate",
            "--rollout-engine", "sglang", "--log-dir", str(tmp_path / "log"), "--no-wandb", "--no-progress",
            "--seed", "7", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--global-batch-size", "2"]
    if resume:
        argv += ["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "ckpt")]  # the launchers' pattern
    with pytest.raises(_Stop) if run is None else contextlib.nullcontext():
        train_mod.train(build_parser().parse_args(argv + list(extra)))
    return log


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_engines_are_released_before_the_actor_allocates(world, tmp_path, monkeypatch, resume):
    """--colocate start-up: the engines come up and release weights, KV cache and CUDA graphs before the actor is
    built (and, resuming, before the checkpoint's optimizer state is loaded); the first generation phase then
    offloads the actor, resumes the engines' weights, pushes the actor's (the release dropped theirs), and
    resumes KV cache and CUDA graphs. The old order built the actor next to resident engines and pushed nothing
    on a fresh start."""
    log = _run_startup(world, tmp_path, monkeypatch, resume=resume)
    released = ("release", ("weights", "kv_cache", "cuda_graph"))
    step = 1 if resume else 0
    assert log == ["engine up", released, "build actor", *(["load checkpoint"] if resume else []), "offload",
                   ("resume", ("weights",)), ("push", step), ("resume", ("kv_cache", "cuda_graph")),
                   ("step", step + 1), "shutdown"]


def test_a_colocated_run_hands_its_frozen_models_to_the_offloader(world, tmp_path, monkeypatch):
    """train.py wiring: with --ref-load and --teacher-load under --colocate, the PhaseSwitcher's offloader holds both
    frozen models' modules (moved to host with the actor's state while generating)."""
    from megatron_dapo.actor.reference import ReferenceSource, TeacherSource
    from megatron_dapo.trainer import build

    ref, teacher = (type("Frozen", (), {"modules": [torch.nn.Linear(2, 2)]})() for _ in range(2))
    monkeypatch.setattr(build, "frozen_models", lambda *a, **kw: ((ReferenceSource(kind="hf", path="r"), ref),
                                                                 (TeacherSource(kind="hf", path="t"), teacher)))
    seen = []

    def run(trainer):
        seen.append(list(trainer.phases.offloader.frozen))
        assert trainer.ref is ref and trainer.teacher is teacher

    _run_startup(world, tmp_path, monkeypatch, resume=False, run=run,
                 extra=("--ref-load", "initial", "--kl-coef", "0.1", "--teacher-load", "initial", "--distill-coef",
                        "1"))
    assert seen == [ref.modules + teacher.modules]


def test_the_engines_release_their_memory_before_the_hf_export(world, tmp_path, monkeypatch):
    """--colocate --export-hf: the run ends in a generation phase (engines resident: at 32B 65.6 GiB of SGLang next
    to the actor's weights, 71.4 GiB planned of 80); the engines release weights, KV cache and CUDA graphs before
    the export's TP gathers (up to 2.9 GiB at 32B) allocate, and the export then runs."""
    def run(trainer):  # the loop's last step ends generating, as every step does
        trainer.phases.to_generation(lambda: {})

    log = _run_startup(world, tmp_path, monkeypatch, resume=False, extra=("--export-hf", str(tmp_path / "hf")),
                       run=run)
    released = ("release", ("weights", "kv_cache", "cuda_graph"))
    assert log[-5:] == [("resume", ("weights",)), ("resume", ("kv_cache", "cuda_graph")), released, ("export", 0),
                        "shutdown"]


# ---- what is resident when a colocated run saves (issue 37 defect 4) ----------------------------------------
class _MemoryEngine:
    """SGLang's memory stand-in: which of its tags (weights, kv_cache, cuda_graph) it holds now. It starts released,
    as start_colocated_engines leaves the engines before the actor is built."""

    def __init__(self) -> None:
        self.resident: set[str] = set()

    def release_memory_occupation(self, tags) -> None:
        self.resident -= set(tags)

    def resume_memory_occupation(self, tags) -> None:
        self.resident |= set(tags)


def _resident(actor: MegatronActor, engine: _MemoryEngine) -> set[str]:
    """What holds device memory now: the actor's params, its DDP grad buffers, its optimizer state (fp32 main params
    and Adam moments), and the engine's tags."""
    def held(tensors) -> bool:
        sizes = [t.untyped_storage().nbytes() for t in tensors]
        assert all(sizes) or not any(sizes), "partly offloaded"
        return bool(sizes) and all(sizes)

    leaves = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    state = [v for o in leaves for s in o.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    parts = {"actor params": held([p for c in actor.chunks for p in c.parameters()]),
             "actor grads": held([b.grad_data for c in actor.chunks for b in c.buffers]),
             "optimizer state": held(state)}
    return {k for k, v in parts.items() if v} | {f"engine {t}" for t in engine.resident}


def test_a_colocated_save_runs_in_the_training_phase_and_holds_the_steps_state(world, tmp_path):
    """Trainer.run --colocate with --save every step: each save runs while the engine is released (at 32B its weights,
    KV cache and graphs, 65.6 GiB, cannot sit next to the actor's onloaded grads and optimizer state: 81.9 GiB on an
    80 GB GPU, the planner's save row), and the step-2 checkpoint loads into a fresh actor equal, bit for bit, to an
    actor that trained the same two steps never offloaded (params, fp32 main params and Adam state, scheduler).
    After the run the actor is offloaded and the engine resident, as every generation phase leaves them."""
    from types import SimpleNamespace

    from megatron_dapo.checkpoint.checkpointer import Checkpointer
    from megatron_dapo.checkpoint.training import load_checkpoint
    from megatron_dapo.rollout.collect import CollectConfig, DynamicSamplingConfig, OverlongConfig
    from megatron_dapo.rollout.types import SamplingParams
    from megatron_dapo.trainer.loop import Rollout, Trainer, TrainerConfig
    from tests.checkpoint_helpers import optimizer_state

    cfg = {"max_tokens_per_micro_batch": 64, "params_dtype": "bfloat16",
           "use_distributed_optimizer": True}  # the production optimizer
    actor, engine, pushed = world_actor(world, **cfg), _MemoryEngine(), []
    collect = CollectConfig(n_samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=3),
                            dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=1, enabled=False),
                            overlong=OverlongConfig(max_response_length=3))
    trainer = Trainer(config=TrainerConfig(num_steps=2, save_dir=str(tmp_path), save_interval=1), collect=collect,
                      actor=actor, engine=engine, next_prompts=lambda k: [], eval_prompts=[], decode=str,
                      reward_fn=None, logger=None,
                      phases=PhaseSwitcher(offloader=ActorOffloader(actor.chunks, actor.optimizer), engine=engine),
                      weight_sync=SimpleNamespace(push=lambda a, v: pushed.append(v) or {}))
    # one mini-batch a step, the rollout stood in for: the batch train() gets is the one the reference trains on
    trainer.rank0_batch = lambda step: ({}, [[[Rollout(s, torch.zeros(s.response_len))
                                               for s in make_samples(4, seed=40 + step)]]])
    trainer.checkpointer = Checkpointer({"actor": actor, "trainer": trainer}, save_dir=str(tmp_path), load_dir=None)
    saver_save, at_save = trainer.checkpointer.saver.save, []
    trainer.checkpointer.saver.save = lambda step, a, extra: at_save.append((step, _resident(actor, engine))) \
        or saver_save(step, a, extra)
    trainer.run()
    trainer.checkpointer.close()
    everything_but_the_engine = {"actor params", "actor grads", "optimizer state"}
    assert at_save == [(1, everything_but_the_engine), (2, everything_but_the_engine)]
    assert pushed == [0, 1, 2] and trainer.phases.phase == "generation"
    assert _resident(actor, engine) == {"actor params", "engine weights", "engine kv_cache", "engine cuda_graph"}
    with pytest.raises(RuntimeError, match="in the colocated 'generation' phase"):
        trainer.save(3)  # the old save's moment: refused, not onloaded next to the engine

    ref = world_actor(world, **cfg)
    for step in (1, 2):
        ref.train_step(make_samples(4, seed=40 + step), rollout_step=step)
    resumed = world_actor(world, **cfg)
    assert load_checkpoint(tmp_path, resumed)["step"] == 2
    want, got = optimizer_state(ref), optimizer_state(resumed)
    assert set(want) == set(got) and any(k.startswith("model.") for k in want)
    for key in want:
        assert torch.equal(want[key], got[key]), key
    assert resumed.scheduler.state_dict() == ref.scheduler.state_dict()
