"""The training loop and what it needs around it: data plane, start-up checks, metrics, colocation phases."""
