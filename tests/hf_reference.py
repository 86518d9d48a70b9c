"""What the tests compute on the HF model directly, as the independent reference: a response's terms (the actor's loss
tests), the experts an MoE model routes each token to (the rollout engines' routing data)."""

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
