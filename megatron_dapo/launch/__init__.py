"""Launching a run on a cluster: which node does what (roles.py), the rollout nodes' server supervisor
(rollout_node.py) and the wait for every server before the trainer starts (wait_servers.py). The bash side is
examples/lib/launch.sh and examples/slurm/; docs/LAUNCH.md walks through it."""
