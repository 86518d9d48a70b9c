"""The sglang.launch_server flags of the servers a launcher starts for one trainer command line.

    python -m megatron_dapo.launch.server_args --server-args="$SGLANG_SERVER_ARGS" -- TRAINER FLAGS...

prints the servers' extra flags: the given ones, then each flag the trainer's flags require of every server that
they lack (rollout/sglang/server.py `trainer_server_flags`, the rule ServerConfig applies to the servers the
trainer launches itself: --enable-return-routed-experts with --moe-routing-replay). The trainer's flags are read
by the trainer's own parser, so an abbreviation argparse accepts or a repeated flag counts as the trainer will
take it. examples/lib/launch.sh `server_flags` runs it for examples/slurm/job.sh (the rollout nodes' and the
colocated nodes' servers) and the by-hand launchers; a trainer flag that does not parse exits 2 with argparse's
message, as the trainer would.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def server_args(given: str, trainer_argv: Sequence[str]) -> str:
    """`given` (sglang.launch_server flags, one string) followed by each flag the trainer command line
    `trainer_argv` requires of its servers that `given` lacks. SystemExit(2) when `trainer_argv` does not parse."""
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.rollout.sglang.server import trainer_server_flags

    args = build_parser().parse_args(list(trainer_argv))
    have = given.split()
    need = [f for f in trainer_server_flags(moe_routing_replay=args.moe_routing_replay) if f not in have]
    return " ".join(have + need)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m megatron_dapo.launch.server_args [--server-args=FLAGS] -- TRAINER FLAGS...",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.launch.server_args",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--server-args", default="", help="the servers' flags so far, one string (write it with '=')")
    own = p.parse_args(argv[:split])
    print(server_args(own.server_args, argv[split + 1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
