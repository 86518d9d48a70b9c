"""Discrete-event models of the rollout servers and the trainer that drive the real scheduling code
(tools/sim_async.py)."""
