"""What the tests compute on the HF model directly, as the independent reference: a response's terms (the actor's loss
tests), the experts an MoE model routes each token to (the rollout engines' routing data), the margin of those routing
decisions; and the weights the logits-vs-HF tests draw so that every family feature shows in the logits."""

from __future__ import annotations

import torch


def response_terms(hf, sample) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs [L] of `sample`'s response tokens under `hf`, with grad; its old log-probs [L]: the recorded ones,
    else these detached; its loss mask [L]: the sample's, else ones). `sample` is an actor TrainSample."""
    logits = hf(torch.tensor([sample.tokens])).logits[0]
    logp = torch.log_softmax(logits.float(), -1)[torch.arange(sample.prompt_len - 1, len(sample.tokens) - 1),
                                                 torch.tensor(sample.tokens[sample.prompt_len:])]
    old = logp.detach() if sample.old_log_probs is None else sample.old_log_probs
    mask = torch.ones(sample.response_len) if sample.loss_mask is None else sample.loss_mask
    return logp, old, mask


def hf_routes(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), num_layers, top_k] expert ids of a teacher-forced HF forward (hooks on `Qwen3MoeTopKRouter`, whose
    forward returns (logits, scores, indices)); a dense layer's column stays 0."""
    config = model.config
    out = torch.zeros(len(ids), config.num_hidden_layers, config.num_experts_per_tok, dtype=torch.long)

    def keep(i: int):
        def hook(_module, _inputs, output) -> None:  # returns None: the router's output stays as it is
            out[:, i] = output[2]
        return hook

    hooks = [layer.mlp.gate.register_forward_hook(keep(i))
             for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return out


def sharpen_weights(model, *, qk_gain: float = 3.0):
    """Redraw `model`'s projection weights in place so each feature a family has moves the logits by O(1); return it.

    At HF's init (std 0.02) every layer adds ~0.02^2 * width to the residual stream, the attention scores are ~1e-2
    wide (softmax almost uniform) and the logits ~0.5: dropping llama3's rope scaling then moved them by 1.5e-5.
    Here every 2-D projection and every fused expert tensor is N(0, 1 / fan_in) (activations stay O(1) through the
    layers) and q_proj / k_proj are `qk_gain` x that (scores ~qk_gain^2 = 9 wide: attention nearly picks one
    position, so a rotation or a scale of q or k changes what each position reads). The embedding keeps HF's std 0.02
    (the first RMSNorm then divides by ~0.02: its eps matters) and MoE routers (`mlp.gate.weight`) keep theirs
    (`draw_routers` sets them); biases and norms stay as `tiny_hf_model` drew them (non-zero, non-unit)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or name.endswith(("embed_tokens.weight", "mlp.gate.weight")):
                continue
            p.normal_(0.0, p.shape[-1] ** -0.5)  # fan_in is the last dim: [out, in], fused experts [E, out, in]
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
    return model


def forward_with_gate_hooks(model, ids: torch.Tensor, hook) -> None:
    """One no-grad forward of the HF MoE `model` on `ids` with `hook` (a forward hook) on every MoE layer's
    `mlp.gate`, removed afterwards."""
    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()


def router_topk_margin(model, ids: torch.Tensor) -> float:
    """The smallest gap, over the tokens of `ids` [b, s] and the MoE layers, between a token's k-th and (k+1)-th
    ranked expert score in a forward of the HF MoE `model`: a routing decision two fp32 implementations could take
    differently only if their rounding moves a score by about this much.

    What is ranked is what the router's top-k ranks: a softmax router's logits (`Qwen3MoeTopKRouter`, whose forward
    returns them first); a DeepSeek-V3 router's (`DeepseekV3TopkRouter`: it has `e_score_correction_bias`) sigmoid
    scores plus that bias, among the experts of the `topk_group` groups of largest top-2 sum (a gap the group
    choice leaves undefined counts as 1)."""
    k = model.config.num_experts_per_tok
    gaps: list[torch.Tensor] = []

    def hook(module, inputs, output) -> None:
        if not hasattr(module, "e_score_correction_bias"):
            top = output[0].topk(k + 1, dim=-1).values
            gaps.append((top[:, k - 1] - top[:, k]).min())
            return
        x = inputs[0].reshape(-1, module.weight.shape[1]).float()
        scores = torch.sigmoid(x @ module.weight.float().T) + module.e_score_correction_bias
        groups = scores.view(len(x), module.num_group, -1)
        keep = groups.topk(2, dim=-1).values.sum(-1).topk(module.topk_group, dim=-1).indices
        mask = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter(1, keep, True)
        top = groups.masked_fill(~mask[..., None], float("-inf")).view(len(x), -1).topk(k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).nan_to_num(posinf=1.0, neginf=1.0).min())

    forward_with_gate_hooks(model, ids, hook)
    return float(torch.stack(gaps).min())


LOGIT_RTOL = 1e-4
"""Tolerance of megatron-core's fp32 logits against HF's, relative to the largest |HF logit| (`assert_logits_close`).

The two compute one function with different fp32 summation orders (fused qkv and fc1, the attention's masking, the
experts' dispatch). A sum of n rounded terms is off by ~sqrt(n) u of its scale (u = 2^-24 = 6e-8; n <= 128 here:
the positions, hidden 64, ffn 96-128), <= 7e-7; about 8 such reductions chain per layer (norm, qkv, scores, softmax,
its weighted sum, o_proj, fc1, fc2), 4 layers and the head: <= 33 x 7e-7 = 2.3e-5 if each error passed through at
gain 1. `sharpen_weights`' attention scores (~10 wide) and SwiGLU amplify a relative error a few times: 1e-4 covers
that. Measured: 0 for the dense families (same kernels, same order), <= 4.3e-6 for MoE (the experts' sums in
another order; the tied head's logits are the smallest, 0.66), on AVX512 and under ATEN_CPU_CAPABILITY=avx2 /
default. Removing what makes a family moves the logits by 0.2-1.6 of that scale (llama3 rope scaling 0.64, Qwen3's
q/k norms 1.2, head_dim's softmax scale 0.32, Qwen2's q/k/v biases 0.65, norm_topk_prob 0.42, top-k + 1 0.26,
sigmoid scores 0.49, MoE layer choice 0.83); an RMSNorm eps of 1e-5 for 1e-6 by 1e-2."""


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """megatron-core logits `got` equal HF's `want` (same shape) within LOGIT_RTOL x max |want|."""
    torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_RTOL * want.abs().max().item())
