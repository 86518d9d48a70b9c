"""`python -m megatron_dapo.planner <train.py flags>`: the trainer's --dry-run, its status (startup.dry_run)."""

import sys

if __name__ == "__main__":
    from megatron_dapo.startup import dry_run_main

    sys.exit(dry_run_main(sys.argv[1:]))
