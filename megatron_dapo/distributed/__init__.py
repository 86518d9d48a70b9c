"""Process groups and collectives: the parallel layout, device-aware collectives, process liveness."""
