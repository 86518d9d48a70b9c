"""HF Qwen2/Qwen2.5 <-> Megatron checkpoint converter (`python -m checkpoint_convert --help`)."""

from checkpoint_convert.hf_to_mcore import HfToMcoreConfig, hf_to_mcore
from checkpoint_convert.mcore_to_hf import McoreToHfConfig, mcore_to_hf

__all__ = ["HfToMcoreConfig", "McoreToHfConfig", "hf_to_mcore", "mcore_to_hf"]
