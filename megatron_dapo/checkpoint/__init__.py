"""Training checkpoints (torch_dist), their manifest, converter-format checkpoints and HF export."""
