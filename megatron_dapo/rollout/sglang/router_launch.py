"""sglang-router with its API key read from a file, not from its command line.

`python -m megatron_dapo.rollout.sglang.router_launch --api-key-file PATH ROUTER_ARGS...` runs sglang_router
0.3.2's launch_router with ROUTER_ARGS (sglang_router's own flags) plus the key from PATH, a server group's 0600
key file (megatron_dapo.rollout.sglang.api_key.write_server_key_file). sglang_router takes the key only as a
command-line option (router_args.py), where every user of the node would read it with ps. Here the option is
added to the parsed list in-process, so no process's command line carries it. The router then sends the key to
its workers and refuses calls without it (401).

Runs in the SGLang interpreter (ServerConfig.python), so megatron_dapo must be importable there: the editable
install of tools/setup_sglang_env.sh, the trainer's own interpreter, or the repo root as working directory.
"""

from __future__ import annotations

import sys

from megatron_dapo.rollout.sglang.api_key import read_server_key_file


def router_argv(argv: list[str]) -> list[str]:
    """sglang_router's arguments: `argv` without a leading `--api-key-file PATH`, plus the key in that file as
    its api-key option (when the file is given)."""
    if argv[:1] != ["--api-key-file"]:
        return list(argv)
    if len(argv) < 2:
        raise SystemExit("sglang_router_launch: --api-key-file needs a path")
    return [*argv[2:], "--api-key", read_server_key_file(argv[1])]


def main(argv: list[str] | None = None) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    launch_router(parse_router_args(router_argv(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
