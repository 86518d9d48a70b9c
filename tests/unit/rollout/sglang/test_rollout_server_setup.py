"""Where launched SGLang servers run, how weights reach them, and seeded-rollout reproducibility
(megatron_dapo/rollout/sglang/setup.py, weight_sync/transports weight_sync_mode and rollout/build.py
make_rollout_engine on a simulated CUDA machine)."""

from __future__ import annotations

import httpx
import pytest
import torch

import megatron_dapo.rollout as rollout_pkg
from megatron_dapo.arguments import build_parser
from megatron_dapo.rollout import build as rollout_build
from megatron_dapo.rollout.build import make_rollout_engine
from megatron_dapo.rollout.sglang.setup import (
    DETERMINISTIC_FLAG,
    attached_determinism_warnings,
    deterministic_server_args,
    launched_server_gpus,
    physical_gpu,
    server_deterministic,
)
from megatron_dapo.startup import engine_config, model_arch
from megatron_dapo.weight_sync.transports import weight_sync_mode

BASE = ["--hf-checkpoint", "/models/fake", "--prompt-data", "p.jsonl", "--num-steps", "1",
        "--rollout-engine", "sglang"]


def test_launched_servers_on_cuda_need_their_gpus_or_an_explicit_colocate():
    with pytest.raises(ValueError, match="--sglang-gpus .*--colocate"):
        launched_server_gpus(cuda=True, sglang_gpus=None, colocate=False)
    assert launched_server_gpus(cuda=True, sglang_gpus="4,5,6,7", colocate=False) == \
        {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert launched_server_gpus(cuda=True, sglang_gpus=None, colocate=True) == {}
    assert launched_server_gpus(cuda=False, sglang_gpus=None, colocate=False) == {}  # CPU servers
    # --sglang-gpus with --colocate, or naming no GPU: RolloutEngineConfig's checks (tests/unit/rollout/test_build.py)


def test_weight_sync_mode_follows_server_placement():
    assert weight_sync_mode(requested=None, attach=True, cuda=True, colocate=False) == "distributed"
    assert weight_sync_mode(requested=None, attach=False, cuda=True, colocate=False) == "distributed"
    assert weight_sync_mode(requested=None, attach=False, cuda=True, colocate=True) == "tensor"
    assert weight_sync_mode(requested=None, attach=False, cuda=False, colocate=False) == "tensor"
    # CUDA IPC needs the servers to see rank 0's GPU.
    with pytest.raises(ValueError, match="--weight-sync-mode distributed"):
        weight_sync_mode(requested="tensor", attach=False, cuda=True, colocate=False, trainer_gpu="0",
                         server_gpus="4,5,6,7")
    assert weight_sync_mode(requested="tensor", attach=False, cuda=True, colocate=False, trainer_gpu="4",
                            server_gpus="4,5") == "tensor"
    assert physical_gpu(1, "0,1,2,3") == "1" and physical_gpu(2, "4, 5, 6") == "6"
    assert physical_gpu(3, None) == "3" and physical_gpu(0, "GPU-abc") == "GPU-abc"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        physical_gpu(2, "0,1")


def test_deterministic_flag_for_seeded_cuda_servers():
    flags, note = deterministic_server_args(seeded=True, wanted=True, device="cuda", extra_args=())
    assert flags == (DETERMINISTIC_FLAG,) and "reproducible" in note
    flags, note = deterministic_server_args(seeded=True, wanted=False, device="cuda", extra_args=())
    assert flags == () and "warning" in note and "--no-sglang-deterministic-inference" in note
    assert deterministic_server_args(seeded=True, wanted=True, device="cuda",
                                     extra_args=("--dtype", "bfloat16", DETERMINISTIC_FLAG))[0] == ()
    flags, note = deterministic_server_args(seeded=True, wanted=True, device="cpu", extra_args=())
    assert flags == () and "not reproducible" in note  # torch_native attention has no deterministic mode
    assert deterministic_server_args(seeded=False, wanted=True, device="cuda", extra_args=()) == ((), None)


class _Resp:
    def __init__(self, code: int, body):
        self.status_code, self._body = code, body

    def json(self):
        return self._body


def test_attached_servers_are_asked_through_server_info():
    answers = {
        "http://a:1/server_info": _Resp(200, {"enable_deterministic_inference": True, "tp_size": 8}),
        "http://b:1/server_info": _Resp(200, {"enable_deterministic_inference": False}),
        "http://c:1/server_info": _Resp(404, {}),  # an older server: the deprecated path answers
        "http://c:1/get_server_info": _Resp(200, {"enable_deterministic_inference": True}),
    }

    def get(url, timeout, headers):
        assert headers == {}
        if url.startswith("http://d:1"):
            raise httpx.ConnectError("refused")
        return answers.get(url, _Resp(404, {}))

    assert [server_deterministic(u, get) for u in ("http://a:1", "http://b:1/", "http://c:1", "http://d:1")] == \
        [True, False, True, None]
    lines = attached_determinism_warnings(["http://a:1", "http://b:1", "http://d:1"], seeded=True, get=get)
    assert len(lines) == 2
    assert "http://b:1" in lines[0] and DETERMINISTIC_FLAG in lines[0]
    assert "http://d:1" in lines[1] and "could not read" in lines[1]
    assert attached_determinism_warnings(["http://b:1"], seeded=False, get=get) == []


def engine(argv: list[str]):
    """The rollout engine's config of these flags as start-up parses it (startup.engine_config), with the model of
    --hf-checkpoint when it has a config.json."""
    args = build_parser().parse_args(argv)
    return engine_config(args, model_arch(args.hf_checkpoint), api_key=None)


@pytest.fixture
def on_cuda(monkeypatch):
    """make_rollout_engine as on a CUDA machine whose rank 0 is GPU 0; make_engine records its arguments."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    made = []
    monkeypatch.setattr(rollout_pkg, "make_engine", lambda *a, **kw: made.append((a, kw)) or "engine")
    return made


def test_make_rollout_engine_on_cuda(on_cuda, capsys):
    with pytest.raises(ValueError, match="--sglang-gpus"):
        make_rollout_engine(engine(BASE), tokenizer=None)
    assert not on_cuda  # nothing launched

    cfg = engine(BASE + ["--sglang-gpus", "4,5"])
    assert make_rollout_engine(cfg, None) == "engine"
    (_, server), kw = on_cuda[-1]
    assert server.env == {"CUDA_VISIBLE_DEVICES": "4,5"} and server.device == "cuda"
    assert DETERMINISTIC_FLAG in server.extra_args
    assert rollout_build.weight_sync_mode(cfg) == "distributed" and kw["client"].sync_backend == "nccl"
    assert DETERMINISTIC_FLAG in capsys.readouterr().out

    cfg = engine(BASE + ["--colocate", "--mem-fraction-static", "0.7", "--no-sglang-deterministic-inference"])
    make_rollout_engine(cfg, None)
    (_, server), kw = on_cuda[-1]
    assert server.env == {} and DETERMINISTIC_FLAG not in server.extra_args
    assert server.extra_args[-3:] == ("--mem-fraction-static", "0.7", "--enable-memory-saver")
    assert rollout_build.weight_sync_mode(cfg) == "tensor"
    assert "not reproducible" in capsys.readouterr().out

    with pytest.raises(ValueError, match="cannot open"):
        make_rollout_engine(engine(BASE + ["--sglang-gpus", "4,5", "--weight-sync-mode", "tensor"]), None)


@pytest.mark.parametrize("overrides", [dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2)],
                         ids=["mlp_only_layers", "decoder_sparse_step"])
def test_sglang_refuses_moe_model_with_dense_layers_before_launch(tmp_path, monkeypatch, overrides):
    """SGLang 0.5.23 builds every qwen3_moe layer sparse and drops dense weights: a model with dense layers is refused
    at start-up (check_flags and make_rollout_engine), naming the dense layers as HF builds them and the fields."""
    import json
    import re

    from megatron_dapo.models.registry import family
    from megatron_dapo.rollout.build import check_rollout_model
    from megatron_dapo.startup import check_flags

    fam = family("qwen3_moe")
    fields = {**fam.tiny_config, "model_type": "qwen3_moe", **overrides}
    hf = fam.hf_causal_lm()(fam.hf_config(**fields))
    dense = [i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "gate")]  # HF's own choice
    assert dense
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "config.json").write_text(json.dumps(fields))
    args = build_parser().parse_args([*BASE, "--hf-checkpoint", str(tmp_path / "mixed")])
    want = rf"layers {re.escape(str(dense))} .*dense .*mlp_only_layers / decoder_sparse_step.*qwen3_moe.py:877"
    with pytest.raises(ValueError, match=want):
        check_rollout_model(engine([*BASE, "--hf-checkpoint", str(tmp_path / "mixed")]))
    with pytest.raises(ValueError, match=want):
        check_flags(args)
    launched = []
    monkeypatch.setattr(rollout_pkg, "make_engine", lambda *a, **k: launched.append(a))
    with pytest.raises(ValueError, match=want):
        make_rollout_engine(engine([*BASE, "--hf-checkpoint", str(tmp_path / "mixed")]), None)
    assert launched == []  # nothing was started
    # the embedded engine serves it (transformers builds the dense layers), and an all-MoE model goes to SGLang
    check_rollout_model(engine([*BASE, "--hf-checkpoint", str(tmp_path / "mixed"), "--rollout-engine", "embedded"]))
    (tmp_path / "sparse").mkdir()
    (tmp_path / "sparse" / "config.json").write_text(json.dumps({**fam.tiny_config, "model_type": "qwen3_moe"}))
    check_rollout_model(engine([*BASE, "--hf-checkpoint", str(tmp_path / "sparse"), "--moe-routing-replay"]))
    # --moe-routing-replay needs experts: refused for a dense model, whatever the engine
    from megatron_dapo.models.registry import family as dense_family

    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({**dense_family("qwen3").tiny_config,
                                                                "model_type": "qwen3"}))
    for kind in ("sglang", "embedded"):
        with pytest.raises(ValueError, match="--moe-routing-replay needs a mixture-of-experts model"):
            check_rollout_model(engine([*BASE, "--hf-checkpoint", str(tmp_path / "dense"),
                                        "--rollout-engine", kind, "--moe-routing-replay"]))


def test_sglang_takes_deepseek_v3_dense_first_layers(tmp_path):
    """The dense-layer refusal is Qwen3-MoE's (the family's `sglang_refusal`): SGLang's deepseek_v2 builds
    first_k_dense_replace dense layers as HF does (tests/sglang/test_sglang_families.py serves one), so a DeepSeek-V3
    config with a dense first layer goes to SGLang, routing replay included."""
    import json

    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.models.registry import family
    from megatron_dapo.rollout.build import check_rollout_model

    fields = {**family("deepseek_v3").tiny_config, "model_type": "deepseek_v3"}
    assert not ModelArch.from_hf(fields).all_layers_moe
    (tmp_path / "dsv3").mkdir()
    (tmp_path / "dsv3" / "config.json").write_text(json.dumps(fields))
    check_rollout_model(engine([*BASE, "--hf-checkpoint", str(tmp_path / "dsv3"), "--moe-routing-replay"]))
