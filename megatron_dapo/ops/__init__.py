"""Fused token-level log-prob / entropy kernels (Triton on GPU, chunked torch on CPU), vocab-parallel."""

from megatron_dapo.ops.backend import BACKENDS, resolve_backend
from megatron_dapo.ops.fused_linear import fused_linear_logprob_entropy
from megatron_dapo.ops.token_logprob import token_logprob_entropy

__all__ = ["BACKENDS", "fused_linear_logprob_entropy", "resolve_backend", "token_logprob_entropy"]
