"""A real CPU SGLang 0.5.23 server (torch-native, fp32) on a tiny random `DeepseekV3ForCausalLM` (the
deepseek_v3 family's `tiny_config`: q_lora 48, kv_lora 32, nope 16 + rope 8, v 12, 8 experts in 4 groups, top-4,
one shared expert, first layer dense). Issue 43 item 4; the findings, with file:line, are in
docs/DEEPSEEK_V3.md.

What a server needs for it on CPU:
- this checkout's CPU guard first on its path (tools/sgl_kernel_stub/megatron_dapo_cpu_guard.py, fix 3): without it
  the first prefill dies in torch_native's SDPA (SGLang sends a prefix-free extend to its MHA path, which
  torch_native cannot run on an MLA KV pool);
- config.json with `moe_layer_freq`, `topk_method`, `scoring_func` (every DeepSeek-V3 checkpoint has them;
  transformers 5's DeepseekV3Config drops them on save_pretrained unless given, and SGLang reads them without a
  default);
- YaRN rope scaling: SGLang's CPU rope factory takes nothing else (rotary_embedding/factory.py:478). DeepSeek-V3
  ships YaRN; a plain-RoPE config (tiny_config as it is: test_sglang_families.py serves it) is served with
  --json-model-override-args giving YaRN of factor 1, which is plain RoPE in SGLang and HF alike.

Then the server's log-probs of sampled responses equal a teacher-forced HF forward within 1e-4 (measured <= 5e-6),
and a weight push over the tensor path (HF names, /update_weights_from_tensor) takes effect, kv_b_proj's absorbed
w_kc / w_vc included (SGLang re-derives them in every load_weights call that carries a kv_b_proj) - as long as a
layer's q_a_proj and kv_a_proj_with_mqa arrive in the same request: SGLang fuses the two and drops either one that
comes without the other (silently), which a check pins, and which every weight sync prevents by keeping the pair
in one bucket (`MappingEntry.sync_with_next`, `weights.mapping.keep_together`), which the last check shows.
Needs .venv-sglang (`make sglang-env`); skipped otherwise.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_dapo.models.deepseek_v3 import FAMILY as FAM
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.hf_params import hf_state_dict
from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from megatron_dapo.weight_sync.buckets import iter_buckets
from megatron_dapo.weight_sync.transports import transport
from megatron_dapo.weights.mapping import keep_together
from tests.sglang.real_server import MARKS, cpu_server_config, max_logprob_error
from tests.torchrun import REPO

pytestmark = [*MARKS, pytest.mark.slow]

GUARD_DIR = REPO / "tools" / "sgl_kernel_stub"
"""This checkout's CPU guard (its fix 3 gives torch_native the absorbed-MLA path), first on the server's path."""

SGLANG_FIELDS = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")
"""DeepSeek-V3's config.json values of the fields SGLang's deepseek_v2.py reads without a default (:2791, :519,
:775); transformers 5.19 saves them only when given."""

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
"""YaRN as DeepSeek-V3 ships it (factor 40, original 4096, mscale = mscale_all_dim = 1), scaled to these <= 44
positions (tests/unit/models/test_models_deepseek_v3.py's)."""

PLAIN_AS_YARN = ("--json-model-override-args", json.dumps({"rope_parameters": {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "original_max_position_embeddings": 256}}))
"""A plain-RoPE config served: SGLang's CPU rope factory asserts YaRN; at factor 1 its YaRN frequencies and
mscales are plain RoPE's."""

PAIRED = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")
"""The two tensors SGLang concatenates into fused_qkv_a_proj_with_mqa (q_lora_rank set): both or neither of a layer
is loaded by one load_weights call (models/deepseek_common/deepseek_weight_loader.py:438-513)."""


def _hf_model(seed: int, **overrides):
    """A tiny random fp32 DeepseekV3ForCausalLM with weights that make each feature show in the log-probs
    (tests/unit/models/test_models_deepseek_v3.py's draw): projections N(0, 1 / fan_in), norms off 1, routers
    at std 0.3, e_score_correction_bias at std 0.1."""
    torch.manual_seed(seed)
    fields = {**FAM.tiny_config, **SGLANG_FIELDS, **overrides}
    hf = FAM.hf_causal_lm()(FAM.hf_config(**fields, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
                                          attn_implementation="eager")).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif p.dim() >= 2 and not name.endswith("embed_tokens.weight"):
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return hf


def _hf_tensors(hf) -> list[tuple[str, torch.Tensor]]:
    """What a push sends: the saved checkpoint's tensors (per-expert names) plus the routers' correction biases."""
    bias = [(n, b.detach()) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
    return [*hf_state_dict(hf).items(), *bias]


def _engine(tmp_path, hf, *extra: str) -> SGLangEngine:
    hf.save_pretrained(tmp_path / "model")
    server = cpu_server_config(tmp_path, extra_args=("--dtype", "float32", *extra),
                               env={"PYTHONPATH": str(GUARD_DIR)})
    return SGLangEngine(server, client=ClientConfig(max_concurrency=8, control_timeout_s=120))


def _samples(engine, seed: int):
    """3 prompts of 20 random tokens x 2 samples of 24 tokens (positions up to 43)."""
    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(max_new_tokens=24, seed=seed)
    reqs = [RolloutRequest(prompt_ids=torch.randint(2, 300, (20,), generator=g).tolist(), n=2, sampling=sp,
                           request_id=f"q{i}") for i in range(3)]
    return [s for group in engine.generate(reqs) for s in group]


def _push(engine, push, hf, version: int, bucket_bytes: int, pairs: dict[str, str] | None = None) -> None:
    """`hf`'s tensors into the server over the tensor path in buckets of `bucket_bytes`, `pairs` kept together
    (ServerPush.update's session, with the bucket size given here)."""
    with engine.weight_update(version) as session:
        session.lost |= push.send(session.targets, iter_buckets(_hf_tensors(hf), bucket_bytes, pairs), version,
                                  session)
    assert not session.lost


def test_yarn_model_logprobs_and_weight_pushes(tmp_path):
    """A YaRN model: HF's log-probs (not plain RoPE's); a push of seed B in one bucket gives B's; a push of seed A
    in buckets too small for a layer's q_a_proj and kv_a_proj_with_mqa together leaves exactly those at B's (SGLang
    drops a half that comes alone); the same small buckets keeping the family's pairs together
    (`weights.mapping.keep_together`, what every weight sync passes) give A's."""
    served, pushed = _hf_model(seed=1, rope_parameters=YARN), _hf_model(seed=2, rope_parameters=YARN)
    engine = _engine(tmp_path, served)
    try:
        before = _samples(engine, seed=3)
        push = transport("tensor")(engine)
        _push(engine, push, pushed, version=1, bucket_bytes=512 << 20)
        after = _samples(engine, seed=4)
        small = 16 << 10  # < q_a_proj (12 KiB) + kv_a_proj_with_mqa (10 KiB) in fp32: never in one bucket
        _push(engine, push, served, version=2, bucket_bytes=small)
        split = _samples(engine, seed=5)
        _push(engine, push, served, version=3, bucket_bytes=small,
              pairs=keep_together(ModelArch.from_hf(served.config)))
        paired = _samples(engine, seed=6)
    finally:
        engine.shutdown()

    err = max_logprob_error(served, before)
    fields = served.config.to_dict()
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": YARN["rope_theta"]}
    plain = type(served)(type(served.config)(**fields)).float().eval()
    plain.load_state_dict(served.state_dict())
    print(f"YaRN: max |server - HF| = {err:.2e}; HF on plain RoPE {max_logprob_error(plain, before):.2e}")
    assert err < 1e-4
    assert max_logprob_error(plain, before) > 1e-4  # the server applies YaRN

    assert {s.weight_version for s in after} == {1}
    err_b, stale = max_logprob_error(pushed, after), max_logprob_error(served, after)
    print(f"after the one-bucket push: max |server - HF(B)| = {err_b:.2e}, vs A {stale:.2e}")
    assert err_b < 1e-4  # every tensor taken, w_kc / w_vc re-derived from the new kv_b_proj
    assert stale > 0.1

    # A everywhere but the fused q/kv down projection, still B's: SGLang dropped each half that came alone
    hybrid = _hf_model(seed=1, rope_parameters=YARN)
    b_params = dict(pushed.named_parameters())
    with torch.no_grad():
        for name, p in hybrid.named_parameters():
            if name.endswith(PAIRED):
                p.copy_(b_params[name])
    assert {s.weight_version for s in split} == {2}
    err_hybrid, err_a = max_logprob_error(hybrid, split), max_logprob_error(served, split)
    print(f"after the {small} B-bucket push of A: vs A {err_a:.2e}, vs A with B's q_a / kv_a_proj {err_hybrid:.2e}")
    assert err_hybrid < 1e-4
    assert err_a > 0.1

    assert {s.weight_version for s in paired} == {3}
    err_paired = max_logprob_error(served, paired)
    print(f"after the {small} B-bucket push of A with the pairs kept together: vs A {err_paired:.2e}")
    assert err_paired < 1e-4
