"""Which node does what in one multi-node run, and the addresses every process derives from that.

Split (`MODE=split`): the first `actor_nodes` nodes run torchrun (node rank = position in the node list, node 0 is
torchrun's master and the weight-sync master); every other node is a rollout node running
`gpus_per_node / sglang_tp` SGLang servers, and the first rollout node also runs the sglang-router in front of all
of them. Colocated (`MODE=colocated`): every node runs its engines and its actor ranks; the trainer addresses the
engines in global rank order (node 0's, then node 1's, ...) and no router sits in front.

At DAPO's 32B setting (examples/recipes/qwen2.5-32b.sh, `sbatch -N 16`, 8 GPUs a node): actor nodes 0-7 hold the
64 ranks (TP 8 x PP 2 x DP 4); nodes 8-15 run two TP-4 servers each (16 servers on ports 30000 and 30001), the
router on node 8 at port 30002. The weight broadcast after every step is 65.5 GB of bf16 weights from the two
pipeline stages' source ranks (global ranks 0 and 32: nodes 0 and 4, since PP is the slowest-varying rank
dimension) to the 16 x 4 server ranks over the inter-node network.

`python -m megatron_dapo.launch.roles` prints the table (`--format table`) or shell assignments that the
launchers evaluate (`--format shell`): one place computes the URLs, ports and node ranks for every launcher.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass

MODES = ("split", "colocated")


@dataclass(frozen=True, kw_only=True)
class JobRoles:
    """The node assignment of one run; see the module docstring."""

    mode: str
    """'split' or 'colocated' (the recipe's MODE)."""
    nodes: tuple[str, ...]
    """Every node of the job, in Slurm's order (`scontrol show hostnames $SLURM_JOB_NODELIST`)."""
    actor_nodes: int
    """Nodes running torchrun: the first ones of `nodes` (split), all of them (colocated)."""
    gpus_per_node: int
    """Actor ranks per actor node (torchrun --nproc_per_node), also the GPUs a rollout node splits into servers."""
    sglang_tp: int
    """GPUs per SGLang server (--sglang-tp-size / --rollout-num-gpus-per-engine)."""
    master_addr: str
    """Node 0's address as the other nodes reach it (torchrun's rendezvous, the weight-sync group's store)."""
    master_port: int = 29500
    weight_sync_port: int = 29650
    """First port of the weight-sync groups on node 0 (--weight-sync-master-port; each re-sync takes the next)."""
    sglang_base_port: int = 30000
    """Server i of a node listens on base + i; the router on base + servers_per_node."""
    router: bool = True
    """Split: an sglang-router on the first rollout node in front of every server (--sglang-router-url)."""
    servers: int | None = None
    """SGLang servers per rollout node (SERVERS_PER_NODE); default gpus_per_node / sglang_tp, every GPU used."""
    attached: tuple[str, ...] = ()
    """Split, attached to servers already running elsewhere (SGLANG_URLS): every node of the job is an actor node
    and these are the server URLs; `attached_router` (SGLANG_ROUTER_URL) the router in front of them, if any."""
    attached_router: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"MODE={self.mode!r}: the recipe must set MODE to one of {', '.join(MODES)}")
        if len(set(self.nodes)) != len(self.nodes) or not self.nodes:
            raise ValueError(f"the node list {list(self.nodes)} is empty or names a node twice")
        if self.gpus_per_node < 1 or self.sglang_tp < 1:
            raise ValueError(f"GPUS_PER_NODE={self.gpus_per_node} and SGLANG_TP={self.sglang_tp} must be >= 1")
        if self.gpus_per_node % self.sglang_tp:
            raise ValueError(f"SGLANG_TP={self.sglang_tp} (the model file's GPUs per SGLang server) must divide "
                             f"GPUS_PER_NODE={self.gpus_per_node}: a server's GPUs are on one node")
        if self.servers is not None and not 1 <= self.servers * self.sglang_tp <= self.gpus_per_node:
            raise ValueError(f"SERVERS_PER_NODE={self.servers} servers of SGLANG_TP={self.sglang_tp} GPUs do not fit "
                             f"a node of GPUS_PER_NODE={self.gpus_per_node}")
        if self.attached and self.mode != "split":
            raise ValueError("SGLANG_URLS (servers already running) is for split runs: a colocated run starts its "
                             "engines on its own GPUs")
        if self.attached and len(self.nodes) != self.actor_nodes:
            raise ValueError(f"attached to running servers (SGLANG_URLS), every node of the job runs the actor: "
                             f"submit with `sbatch -N {self.actor_nodes}` (ACTOR_NODES), the job has {len(self.nodes)}")
        if self.mode == "split" and not self.attached:
            if self.actor_nodes < 1:
                raise ValueError(f"ACTOR_NODES={self.actor_nodes} must be >= 1")
            if len(self.nodes) <= self.actor_nodes:
                raise ValueError(
                    f"a split run needs more nodes than its ACTOR_NODES={self.actor_nodes} (the rest run the SGLang "
                    f"servers); the job has {len(self.nodes)}: submit with `sbatch -N {self.actor_nodes + 1}` or "
                    f"more, or lower ACTOR_NODES")
        elif self.actor_nodes != len(self.nodes):
            raise ValueError(f"a colocated run's actor runs on every node: ACTOR_NODES={self.actor_nodes} but the "
                             f"job has {len(self.nodes)} nodes")
        for name in ("master_port", "weight_sync_port", "sglang_base_port"):
            if not 1024 <= getattr(self, name) <= 65000:
                raise ValueError(f"{name.upper()}={getattr(self, name)} is not a usable port (1024-65000)")

    @property
    def actor(self) -> tuple[str, ...]:
        """The nodes running torchrun, node rank i at position i."""
        return self.nodes[: self.actor_nodes]

    @property
    def rollout(self) -> tuple[str, ...]:
        """The nodes running SGLang servers (split: the rest; colocated: every node)."""
        return self.nodes[self.actor_nodes:] if self.mode == "split" else self.nodes

    @property
    def servers_per_node(self) -> int:
        return self.servers if self.servers is not None else self.gpus_per_node // self.sglang_tp

    @property
    def world_size(self) -> int:
        """Actor ranks in all."""
        return self.actor_nodes * self.gpus_per_node

    def server_urls(self, node: str | None = None) -> list[str]:
        """Every server's URL in global order (node by node), or those of `node` only."""
        if self.attached:
            return list(self.attached) if node is None else []
        return [f"http://{n}:{self.sglang_base_port + i}" for n in self.rollout if node in (None, n)
                for i in range(self.servers_per_node)]

    @property
    def router_url(self) -> str | None:
        if self.attached:
            return self.attached_router
        if self.mode != "split" or not self.router:
            return None
        return f"http://{self.rollout[0]}:{self.sglang_base_port + self.servers_per_node}"


def describe(roles: JobRoles) -> str:
    """A table of what runs on each node, the derived addresses, and the world size."""
    lines = [f"{roles.mode} run on {len(roles.nodes)} nodes: {roles.actor_nodes} actor node(s) x "
             f"{roles.gpus_per_node} ranks = {roles.world_size} actor ranks"
             + (", its SGLang servers already running elsewhere" if roles.attached else
                f", {len(roles.rollout)} rollout node(s) x {roles.servers_per_node} SGLang server(s) at TP "
                f"{roles.sglang_tp}" if roles.mode == "split" else
                f", each node also {roles.servers_per_node} SGLang engine(s) at TP {roles.sglang_tp}")]
    for k, node in enumerate(roles.nodes):
        parts = []
        if node in roles.actor:
            rank = roles.actor.index(node)
            parts.append(f"torchrun node_rank {rank} (global ranks {rank * roles.gpus_per_node}-"
                         f"{(rank + 1) * roles.gpus_per_node - 1})" + (", master" if rank == 0 else ""))
        if node in roles.rollout:
            ports = [roles.sglang_base_port + i for i in range(roles.servers_per_node)]
            parts.append(f"SGLang server(s) on port(s) {', '.join(map(str, ports))}")
            if roles.router_url and node == roles.rollout[0]:
                parts.append(f"router on port {roles.sglang_base_port + roles.servers_per_node}")
        lines.append(f"  node {k:>3} {node}: " + "; ".join(parts))
    if roles.attached:
        lines.append(f"  attached to {len(roles.attached)} server(s) already running: {' '.join(roles.attached)}")
    lines.append(f"  rendezvous {roles.master_addr}:{roles.master_port}; weight sync "
                 + (f"from {roles.master_addr}:{roles.weight_sync_port}" if roles.mode == "split" else
                    "by shared handles to each node's own engines")
                 + (f"; router {roles.router_url}" if roles.router_url else "")
                 + f"; {len(roles.server_urls())} server URL(s)")
    return "\n".join(lines)


def shell_assignments(roles: JobRoles) -> str:
    """Bash assignments (safe for `eval`) of what the launchers need: ACTOR_HOSTS, ROLLOUT_HOSTS and
    SERVER_URLS (arrays), ROUTER_URL (empty without one), WORLD_SIZE, SERVERS_PER_NODE."""
    def array(name: str, values: list[str] | tuple[str, ...]) -> str:
        return f"{name}=({' '.join(shlex.quote(v) for v in values)})"

    return "\n".join([
        array("ACTOR_HOSTS", roles.actor), array("ROLLOUT_HOSTS", roles.rollout),
        array("SERVER_URLS", roles.server_urls()), f"ROUTER_URL={shlex.quote(roles.router_url or '')}",
        f"WORLD_SIZE={roles.world_size}", f"SERVERS_PER_NODE={roles.servers_per_node}",
    ])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.launch.roles", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--nodes", nargs="+", required=True, help="the job's node names in order")
    p.add_argument("--actor-nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--sglang-tp", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--weight-sync-port", type=int, default=29650)
    p.add_argument("--sglang-base-port", type=int, default=30000)
    p.add_argument("--servers-per-node", type=int, default=None)
    p.add_argument("--no-router", dest="router", action="store_false")
    p.add_argument("--attach-urls", nargs="+", default=[], help="servers already running (split runs)")
    p.add_argument("--attach-router-url", default=None)
    p.add_argument("--format", choices=("table", "shell"), default="table")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        roles = JobRoles(mode=a.mode, nodes=tuple(a.nodes), actor_nodes=a.actor_nodes, gpus_per_node=a.gpus_per_node,
                         sglang_tp=a.sglang_tp, master_addr=a.master_addr, master_port=a.master_port,
                         weight_sync_port=a.weight_sync_port, sglang_base_port=a.sglang_base_port, router=a.router,
                         servers=a.servers_per_node, attached=tuple(a.attach_urls),
                         attached_router=a.attach_router_url)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(describe(roles) if a.format == "table" else shell_assignments(roles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
