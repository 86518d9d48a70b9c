"""The redaction of the run record (run_config.json, wandb's config): the run's flags with every secret redacted.

A secret is the value of a SECRET_FIELDS entry of the flags as parsed (a plain dict, `vars` of the namespace: the
SGLang API key, however it was given: --sglang-api-key, --sglang-api-key-file or SGLANG_API_KEY, all resolved into
one entry by startup.check_flags). The field itself is replaced by REDACTED, and the secret's text is replaced wherever
else it appears (a key pasted into another flag's value), so no file the run writes holds it. Paths to
key files are kept: they are not secrets and say where the key came from.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_dapo.rollout.sglang import log_redact

SECRET_FIELDS = ("sglang_api_key",)
"""Entries of the parsed flags whose values never go into a file."""

REDACTED = log_redact.REDACTED.decode()
"""The marker a secret's place shows, the same as in the launched servers' logs."""


def secrets_of(flags: Mapping[str, Any]) -> list[str]:
    """The secret values `flags` holds (set SECRET_FIELDS), longest first so a key inside another is hidden too."""
    found = {v for v in (flags.get(f) for f in SECRET_FIELDS) if isinstance(v, str) and v}
    return sorted(found, key=len, reverse=True)


def redact(value: Any, secrets: Sequence[str]) -> Any:
    """`value` with each secret's text replaced by REDACTED in every string, lists/tuples/dicts walked."""
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {redact(k, secrets): redact(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, secrets) for v in value)
    return value


def run_record(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The flags as parsed (`vars` of the namespace) for the run record (run_config.py) and wandb's config, secrets
    redacted (`flags` is not modified)."""
    secrets = secrets_of(flags)
    record = {k: redact(v, secrets) for k, v in flags.items()}
    for name in SECRET_FIELDS:
        if record.get(name) is not None:
            record[name] = REDACTED
    return record


def argv_has_secret(flags: Mapping[str, Any], argv: Sequence[str] | None = None) -> bool:
    """Whether a secret of `flags` is on the command line (`argv`, default sys.argv): --sglang-api-key was
    used, and tools that record the command line (wandb's run metadata) must not."""
    argv = sys.argv if argv is None else argv
    return any(secret in arg for secret in secrets_of(flags) for arg in argv)
