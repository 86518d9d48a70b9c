"""Weight sync from the actor to the rollout engine."""
