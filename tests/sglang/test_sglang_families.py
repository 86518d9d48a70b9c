"""Weight sync into a real SGLang 0.5.23 server (CPU, torch-native, fp32) for every registered family but the one the
other real-server tests serve (`real_server.MODEL_TYPE`, Qwen2).

Per family (one server alive at a time): the server starts on a random model of the family's `tiny_config`
(seed A); a single-process Megatron actor loaded with another random model (seed B, through the library's own
HF -> Megatron load) pushes its weights the way a PP1 training step does (`ServerPush.push`: the actor's
`iter_hf_weights` export, bucketed, over one of the sync paths). The server's log-probs of sampled responses must
then equal a teacher-forced HF forward of seed B (the reference) within 1e-4 (measured: 4.8e-7), so a server
that kept any of A's tensors fails; and before the push, seed A's (SGLang serves the family as HF does).

The cases come from the registry, in its order: the first family tied (the one tied head pushed into a real server;
`real_server.tiny_model` is untied), the others untied; the transport alternates between the tensor path (the CPU
default) and the distributed one (gloo broadcast); an MoE family's server also returns its routed experts. So
Qwen3 is tied, over the tensor path; Llama untied with llama3 rope scaling on (a server on plain RoPE would be
off), over the distributed path; Qwen3-MoE (all layers MoE: 8 experts, top-2; 96 expert tensors by HF per-expert
names) untied over the tensor path, its server started with --enable-return-routed-experts (--moe-routing-replay):
the same server then shows that the experts it routed each token to, for every token and layer, equal HF's top-k
on the pushed weights (a hook on `Qwen3MoeTopKRouter`), also for a partial rollout's continuation (prompt + prefix
re-routed, rows for the whole sequence).
Needs .venv-sglang (`make sglang-env`); skipped otherwise.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import family, model_types
from megatron_dapo.rollout.partial_rollout import continuation_request, extend
from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.rollout.types import RolloutRequest, RoutingShape, SamplingParams
from megatron_dapo.weight_sync.transports import transport
from tests.hf_reference import hf_routes
from tests.sglang.real_server import MARKS, MODEL_TYPE, cpu_server_config, free_port, max_logprob_error
from tests.torchrun import REPO

GUARD_DIR = REPO / "tools" / "sgl_kernel_stub"
"""This checkout's CPU guard (the no-op `_cuda_host_register`), first on the server's path whatever checkout
.venv-sglang's .pth names."""

pytestmark = [*MARKS, pytest.mark.slow]

MODES = ("tensor", "distributed")
"""The push paths the families alternate over (the disk path, like these two, is tried on `tiny_model`)."""


def _is_moe(model_type: str) -> bool:
    """Whether the family's tiny model has mixture-of-experts layers."""
    return ModelArch.from_hf({**family(model_type).tiny_config, "model_type": model_type}).is_moe


def _case(i: int, model_type: str):
    """The i-th served family's case: (model_type, tied, transport)."""
    tied, mode = i == 0, MODES[i % len(MODES)]
    routing = "-routing" if _is_moe(model_type) else ""
    return pytest.param(model_type, tied, mode, id=f"{model_type}-{'tied' if tied else 'untied'}-{mode}{routing}")


CASES = [_case(i, model_type) for i, model_type in enumerate(t for t in model_types() if t != MODEL_TYPE)]


def _hf_model(model_type: str, *, tied: bool, seed: int):
    """A random fp32 model of the family's tiny config. Norms randomised so a q/k-norm mix-up shows; q and k
    projections x10, so attention is sharp enough for the rope to matter: at these <= 15 positions Llama's llama3
    scaling then moves log-probs by ~1e-3 (by ~1e-5 at HF's init scale, under the tolerance)."""
    fam = family(model_type)
    torch.manual_seed(seed)
    config = fam.hf_config(**fam.tiny_config, tie_word_embeddings=tied, eos_token_id=1, bos_token_id=0)
    model = fam.hf_causal_lm()(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("q_proj.weight", "k_proj.weight", "mlp.gate.weight")):
                p.mul_(10.0)  # the router too: decisive top-k choices (no fp32 near-ties between engines)
    return model


def _rope_override(config) -> tuple[str, ...]:
    """Server arguments that serve a plain-RoPE multi-head latent attention model (DeepSeek-V3's tiny config) on
    SGLang's CPU backend, whose MLA rope factory takes only YaRN (rotary_embedding/factory.py:478): YaRN of factor 1,
    which is plain RoPE in SGLang and HF alike (tests/sglang/test_sglang_deepseek_v3.py); none otherwise."""
    rope = config.rope_parameters or {}
    if not getattr(config, "kv_lora_rank", None) or rope.get("rope_type", "default") != "default":
        return ()
    return ("--json-model-override-args", json.dumps({"rope_parameters": {
        "rope_type": "yarn", "rope_theta": rope["rope_theta"], "factor": 1.0,
        "original_max_position_embeddings": config.max_position_embeddings}}))


def _check_routes(model, samples) -> int:
    """Asserts each sample's routed experts equal HF's (order included) for every fed-back token; returns rows."""
    rows = 0
    for s in samples:
        ids = list(s.prompt_ids) + list(s.response_ids)
        assert s.routed_experts is not None and s.routed_experts.dtype == torch.uint8
        want = hf_routes(model, ids)[:-1]  # the last token is never fed back
        assert torch.equal(s.routed_experts.long(), want), s.request_id
        rows += len(want)
    return rows


def _plain_rope_twin(model):
    """The same weights under plain RoPE (rope_scaling dropped): what a server ignoring llama3 scaling computes."""
    fields = model.config.to_dict()
    theta = fields["rope_parameters"]["rope_theta"]
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    twin = type(model)(type(model.config)(**fields)).float().eval()
    twin.load_state_dict(model.state_dict())
    return twin


def _actor(hf_dir):
    """A single-process (TP1 PP1) Megatron actor with `hf_dir`'s weights, loaded as --hf-checkpoint is."""
    from megatron_dapo.actor import ActorConfig, MegatronActor, init_parallel
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.trainer.build import load_hf_into_actor

    layout = init_parallel(seed=0)
    actor = MegatronActor(ModelArch.from_hf(hf_dir), ActorConfig(lr=1e-3), layout)
    load_hf_into_actor(actor, str(hf_dir))
    return actor


def _samples(engine, seed: int):
    sp = SamplingParams(max_new_tokens=12, seed=seed)
    reqs = [RolloutRequest(prompt_ids=[5, 6 + i, 7 * i + 3], n=2, sampling=sp, request_id=f"q{i}")
            for i in range(3)]
    return [s for g in engine.generate(reqs) for s in g]


@pytest.mark.parametrize(("model_type", "tied", "mode"), CASES)
def test_pushed_actor_weights_give_the_server_their_logprobs(tmp_path, model_type, tied, mode):
    from megatron_dapo.actor import destroy_parallel

    served, pushed = _hf_model(model_type, tied=tied, seed=1), _hf_model(model_type, tied=tied, seed=2)
    served.save_pretrained(tmp_path / "model")
    pushed.save_pretrained(tmp_path / "pushed")
    moe = _is_moe(model_type)
    arch = ModelArch.from_hf(served.config)
    routing = RoutingShape(arch.num_layers, arch.num_experts_per_tok, arch.num_experts) if moe else None
    client = ClientConfig(max_concurrency=8, control_timeout_s=120, sync_backend="gloo",
                          sync_master_port=free_port(), routing=routing)
    server = cpu_server_config(tmp_path, return_routed_experts=moe, env={"PYTHONPATH": str(GUARD_DIR)},
                               extra_args=("--dtype", "float32", *_rope_override(served.config)))
    engine = SGLangEngine(server, client=client)
    try:
        before = _samples(engine, seed=3)
        assert max_logprob_error(served, before) < 1e-4  # the server serves the family as HF computes it
        actor = _actor(tmp_path / "pushed")
        try:
            transport(mode)(engine).push(actor, version=1)
        finally:
            destroy_parallel()
        after = _samples(engine, seed=4)
        assert {s.weight_version for s in after} == {1}
        err = max_logprob_error(pushed, after)
        print(f"{model_type} tied={tied} {mode}: max |server - HF(seed B)| = {err:.2e}, "
              f"vs seed A {max_logprob_error(served, after):.2e}")
        assert err < 1e-4
        assert max_logprob_error(served, after) > 0.1  # the server no longer serves seed A
        if pushed.config.rope_parameters.get("rope_type", "default") != "default":
            # llama3 scaling was applied: a server on plain RoPE would be off by more than the tolerance
            plain = max_logprob_error(_plain_rope_twin(pushed), after)
            print(f"{model_type}: HF with plain RoPE vs the server {plain:.2e}")
            assert plain > 1e-4
        if moe:
            rows = _check_routes(pushed, after)
            # a partial rollout: sample 0's first 5 tokens as a prefix, continued; the continuation re-routes prompt
            # + prefix, so the joined sample's rows cover the whole sequence
            first = after[0]
            prefix = type(first)(request_id=first.request_id, index=first.index, prompt_ids=first.prompt_ids,
                                 response_ids=first.response_ids[:5], logprobs=first.logprobs[:5],
                                 finish_reason="abort", weight_version=1,
                                 routed_experts=first.routed_experts[: len(first.prompt_ids) + 4])
            req = continuation_request(first.prompt_ids, prefix, SamplingParams(max_new_tokens=12), 9, "cont")
            (cont,), = engine.generate([req])
            joined = extend(prefix, cont, first.prompt_ids)
            rows += _check_routes(pushed, [joined])
            print(f"{model_type}: routed experts equal HF's top-k on {rows} token rows x "
                  f"{routing.num_layers} layers x top-{routing.top_k}")
    finally:
        engine.shutdown()
