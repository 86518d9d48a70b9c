"""Fused token-level log-prob / entropy kernels (Triton on GPU, chunked torch on CPU), vocab-parallel."""

from megatron_dapo.ops.backend import BACKENDS, resolve_backend
from megatron_dapo.ops.token_logprob import token_logprob_entropy

__all__ = ["BACKENDS", "resolve_backend", "token_logprob_entropy"]
