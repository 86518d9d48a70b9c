"""megatron-dapo: DAPO reinforcement learning on a Megatron-core actor with SGLang rollouts."""

__version__ = "0.1.0"

from megatron_dapo.compat import lazy_compile as _lazy_compile  # noqa: E402

_lazy_compile.install()  # megatron-core's import-time torch.compile calls wait for first use
