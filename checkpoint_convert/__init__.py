"""HF <-> Megatron checkpoint converter for the registered model families (`python -m checkpoint_convert --help`)."""

from checkpoint_convert.hf_to_mcore import HfToMcoreConfig, hf_to_mcore
from checkpoint_convert.mcore_to_hf import McoreToHfConfig, mcore_to_hf

__all__ = ["HfToMcoreConfig", "McoreToHfConfig", "hf_to_mcore", "mcore_to_hf"]
