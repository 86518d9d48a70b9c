"""RolloutEngineConfig (megatron_dapo/rollout/build.py) checks its values at construction: each bad value is a
ValueError naming the flag to fix, raised by startup.engine_config before anything is built or launched (and by
check_flags as a one-line UserError); the values a run may give construct."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_dapo.arguments import build_parser
from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import family
from megatron_dapo.rollout.build import RolloutEngineConfig
from megatron_dapo.startup import check_flags, engine_config

BASE = ["--hf-checkpoint", "/models/fake", "--prompt-data", "p.jsonl", "--num-steps", "1",
        "--rollout-engine", "sglang"]


def engine(argv: list[str] = (), *, arch: ModelArch | None = None, api_key: str | None = None) -> RolloutEngineConfig:
    """The engine's config of BASE + `argv` as start-up parses it (startup.engine_config)."""
    return engine_config(build_parser().parse_args([*BASE, *argv]), arch, api_key=api_key)


def dense_arch() -> ModelArch:
    return ModelArch.from_hf({**family("qwen3").tiny_config, "model_type": "qwen3"})


ATTACHED = dict(sglang_server_urls=("http://r0:30000",))
BAD = [
    pytest.param(dict(kind="vllm"), "--rollout-engine must be one of", id="kind"),
    pytest.param(dict(hf_checkpoint=""), "--hf-checkpoint is empty", id="hf-checkpoint"),
    pytest.param(dict(weight_sync_mode="nccl"), "--weight-sync-mode must be one of", id="weight-sync-mode"),
    pytest.param(dict(async_rollout=2), "--async-rollout must be 0", id="async-rollout"),
    pytest.param(dict(max_batch_size=0), r"--rollout-batch-size x --n-samples-per-prompt .* must be >= 1",
                 id="max-batch-size"),
    pytest.param(dict(rollout_timeout_h=0.0), "--rollout-timeout must be > 0", id="rollout-timeout"),
    pytest.param(dict(rollout_timeout_h=float("nan")), "--rollout-timeout must be > 0", id="rollout-timeout-nan"),
    pytest.param(dict(sglang_num_servers=0), "--sglang-num-servers must be >= 1", id="num-servers"),
    pytest.param(dict(sglang_tp_size=0), r"--sglang-tp-size \(--rollout-num-gpus-per-engine\) must be >= 1",
                 id="tp-size"),
    pytest.param(dict(sglang_max_concurrency=0), "--sglang-max-concurrency must be >= 1", id="max-concurrency"),
    pytest.param(dict(weight_sync_bucket_mb=0), "--weight-sync-bucket-mb must be >= 1", id="bucket-mb"),
    pytest.param(dict(sglang_server_wait_s=0.0), "--sglang-server-wait-s must be > 0", id="server-wait"),
    pytest.param(dict(sglang_http_timeout=float("nan")), "--sglang-http-timeout must be > 0", id="http-timeout"),
    pytest.param(dict(sglang_min_tokens_per_s=0.0), "--sglang-min-tokens-per-s must be > 0", id="min-tokens-per-s"),
    pytest.param(dict(sglang_base_port=80), "--sglang-base-port 80 leaves no room", id="base-port-low"),
    pytest.param(dict(sglang_base_port=65535), "--sglang-base-port 65535 leaves no room", id="base-port-high"),
    pytest.param(dict(weight_sync_master_port=70000), "--weight-sync-master-port must be a port", id="master-port"),
    pytest.param(dict(mem_fraction_static=1.2), r"--mem-fraction-static must be in \(0, 1\)", id="mem-fraction-high"),
    pytest.param(dict(mem_fraction_static=0.0), r"--mem-fraction-static must be in \(0, 1\)", id="mem-fraction-0"),
    pytest.param(dict(mem_fraction_static=0.7, sglang_extra_args=("--mem-fraction-static", "0.5")),
                 "--mem-fraction-static is given in --sglang-extra-args", id="mem-fraction-twice"),
    pytest.param(dict(colocate=True, sglang_extra_args=("--mem-fraction-static", "0.5")),
                 "--mem-fraction-static is given in --sglang-extra-args", id="colocate-mem-fraction-in-extra-args"),
    pytest.param(dict(colocate=True, async_rollout=1), "--colocate and --async-rollout 1 exclude each other",
                 id="colocate-async"),
    pytest.param(dict(colocate=True, max_staleness=2), "--colocate and --max-staleness 2 exclude each other",
                 id="colocate-fully-async"),
    pytest.param(dict(colocate=True, sglang_gpus="4,5"), "--colocate and --sglang-gpus exclude each other",
                 id="colocate-sglang-gpus"),
    pytest.param(dict(colocate=True, weight_sync_mode="distributed"), "--weight-sync-mode must be tensor",
                 id="colocate-weight-sync-mode"),
    pytest.param(dict(colocated_plan=object()), "colocated_plan .* needs --colocate", id="plan-without-colocate"),
    pytest.param(dict(sglang_router_url="http://r:30010"), "--sglang-router-url is for attach mode",
                 id="router-without-urls"),
    pytest.param(dict(sglang_gpus=" , "), "--sglang-gpus must list GPUs", id="sglang-gpus-empty"),
    pytest.param(dict(sglang_host="0.0.0.0"), "--sglang-host 0.0.0.0 without an API key", id="open-bind"),
    pytest.param(dict(sglang_api_key="k3y", sglang_extra_args=("--api-key", "k3y")),
                 "--sglang-extra-args has --api-key", id="key-in-extra-args"),
    pytest.param(dict(sglang_api_key="k3y", sglang_extra_args=("--config=s.yaml",)),
                 "--sglang-extra-args has --config", id="config-in-extra-args"),
    pytest.param(dict(arch=dense_arch(), moe_routing_replay=True), "--moe-routing-replay needs a mixture-of-experts",
                 id="routing-replay-dense"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_a_bad_value_is_refused_naming_its_flag(change, message):
    good = engine()
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(good, **change)


@pytest.mark.parametrize("change", [
    pytest.param({}, id="launched"),
    pytest.param(dict(kind="embedded", sglang_host="0.0.0.0"), id="embedded-ignores-the-bind"),
    pytest.param(dict(colocate=True, weight_sync_mode="tensor", mem_fraction_static=0.7), id="colocated"),
    pytest.param(dict(sglang_extra_args=("--mem-fraction-static", "0.5")), id="sglangs-own-fraction"),
    pytest.param(dict(sglang_gpus="4,5,6,7", weight_sync_mode="distributed"), id="own-gpus"),
    pytest.param(dict(sglang_host="0.0.0.0", sglang_api_key="k3y"), id="keyed-bind"),
    pytest.param(dict(sglang_host="0.0.0.0", sglang_allow_no_api_key=True), id="allowed-open-bind"),
    pytest.param(dict(ATTACHED, sglang_router_url="http://r:30010", sglang_host="0.0.0.0"), id="attached"),
    pytest.param(dict(ATTACHED, sglang_gpus=" , ", sglang_extra_args=("--api-key", "x"), sglang_api_key="k3y"),
                 id="attached-ignores-launch-options"),
    pytest.param(dict(sglang_base_port=65534, weight_sync_master_port=1), id="edge-ports"),
    pytest.param(dict(async_rollout=1, kind="embedded", max_batch_size=1), id="async-embedded"),
])
def test_good_values_construct(change):
    cfg = dataclasses.replace(engine(), **change)
    assert all(getattr(cfg, k) == v for k, v in change.items())


def test_the_flags_reach_the_checks():
    """Flag -> field: start-up's config refuses what the flags give, check_flags as a one-line UserError."""
    with pytest.raises(ValueError, match="--sglang-http-timeout must be > 0 seconds, got 0.0"):
        engine(["--sglang-http-timeout", "0"])
    with pytest.raises(ValueError, match="--colocate and --sglang-gpus exclude each other"):
        engine(["--colocate", "--sglang-gpus", "4"])
    with pytest.raises(UserError, match="^--sglang-router-url is for attach mode"):
        check_flags(build_parser().parse_args([*BASE, "--sglang-router-url", "http://r:30010"]))
    assert engine(["--sglang-server-urls", "http://a:1", "--sglang-router-url", "http://r:2"]).sglang_router_url \
        == "http://r:2"


def test_the_embedded_engine_is_handed_the_parsed_architecture(monkeypatch):
    """make_rollout_engine gives the embedded engine start-up's ModelArch (it parses no config.json itself); without
    one (--hf-checkpoint has no config.json) it refuses as load_inputs does, naming the flag."""
    import megatron_dapo.rollout as rollout_pkg
    from megatron_dapo.rollout.build import make_rollout_engine

    made = []
    monkeypatch.setattr(rollout_pkg, "make_engine", lambda *a, **kw: made.append((a, kw)) or "engine")
    arch = dense_arch()
    assert make_rollout_engine(engine(["--rollout-engine", "embedded"], arch=arch), None) == "engine"
    (args, kwargs), = made
    assert args == ("embedded", "/models/fake") and kwargs["arch"] is arch
    with pytest.raises(UserError, match="^--hf-checkpoint: no HF config at /models/fake: pass the model directory"):
        make_rollout_engine(engine(["--rollout-engine", "embedded"]), None)
    assert len(made) == 1
