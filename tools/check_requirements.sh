#!/usr/bin/env bash
# Resolve the production requirements without installing anything, and check the resolved set against every
# constraint the packages declare, those under extras we do not install included (megatron-core's TE range).
#
# pip --dry-run --report resolves requirements.txt for this interpreter in a throwaway venv (nothing is
# installed anywhere; pip's cache keeps what it downloaded). Where the index serves no separate metadata files
# pip downloads whole wheels to read their metadata: about 6 GB (torch and the CUDA libraries) and 15-25
# minutes the first time on this machine's link, under a minute once cached. Not part of CI for that reason.
# Usage: bash tools/check_requirements.sh [REQUIREMENTS=requirements.txt]
set -euo pipefail
cd "$(dirname "$0")/.."
REQS="${1:-requirements.txt}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check packaging 2> >(grep -v "^WARNING: Location" >&2)
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed \
  --report "$tmp/report.json" -r "$REQS" 2> >(grep -v "^WARNING: Location" >&2)
status=0
"$tmp/venv/bin/python" tools/check_requirements.py "$tmp/report.json" || status=$?
echo "check_requirements: $REQS resolved and checked in $(( $(date +%s) - start )) s"
exit "$status"
