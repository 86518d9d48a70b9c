"""--policy-loss and --advantage-estimator: names, dotted paths, the errors that name the flag, the flag
combinations a loss rejects, a loss's declared metrics, the advantage estimators against their formulas, the help
generated from the registries, and the registry itself (dotted_path.Registry)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from megatron_dapo.actor import ActorConfig
from megatron_dapo.algorithm import PolicyLossConfig, PolicyLossOutput, aggregate, group_advantages, policy_loss
from megatron_dapo.algorithm.advantages import ADVANTAGE_ESTIMATORS, dr_grpo_advantages, grpo_advantages
from megatron_dapo.algorithm.gspo import gspo_loss
from megatron_dapo.algorithm.loss import POLICY_LOSSES, TOKEN_METRICS
from megatron_dapo.algorithm.registry import get_advantage_estimator, policy_loss_config
from megatron_dapo.arguments import build_parser
from megatron_dapo.dotted_path import Registry
from megatron_dapo.errors import UserError
from megatron_dapo.startup import build_configs
from tests.conftest import REPO
from tests.losses import neg_adv_loss

HERE = "tests.unit.algorithm.test_algorithm_registry"  # this module, as a dotted path names it


# ---- user extensions, addressed as HERE:<name> -----------------------------------------------------------------------
def sequence_sum_loss(log_probs, old_log_probs, advantages, mask, config, *, entropy=None, is_weights=None):
    """-A * sum_t logp over each response, averaged over responses (REINFORCE with a sequence-level mean)."""
    num, den = aggregate(-advantages[:, None] * log_probs, mask, "seq-mean-token-sum")
    return PolicyLossOutput(loss_sum=num, denominator=den, metrics={"tokens": mask.sum()})


def two_arg_loss(log_probs, mask):
    raise AssertionError("never called")


def tuple_loss(log_probs, old_log_probs, advantages, mask, config, *, entropy=None, is_weights=None):
    return (log_probs * mask).sum(), mask.sum(), {}


def centred_by_max(rewards, group_ids):
    """R - max of the group."""
    out = rewards.clone()
    for g in set(group_ids):
        idx = torch.tensor([i for i, k in enumerate(group_ids) if k == g])
        out[idx] = rewards[idx] - rewards[idx].max()
    return out


def list_estimator(rewards, group_ids):
    return [0.0] * len(group_ids)


NOT_A_FUNCTION = 3


# ---- policy loss ---------------------------------------------------------------------------------------------
def test_default_is_todays_dapo_loss():
    cfg = policy_loss_config()
    assert cfg.fn is policy_loss and cfg.name == "dapo" and cfg.agg_mode is None
    assert PolicyLossConfig().fn is policy_loss  # built without the registry: DAPO's loss too
    # agg_mode None is DAPO's token-mean: the same numbers as asking for it
    g = torch.Generator().manual_seed(0)
    logp, old, mask = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), torch.ones(3, 4)
    adv = torch.randn(3, generator=g)
    a = policy_loss(logp, old, adv, mask, cfg)
    b = policy_loss(logp, old, adv, mask, PolicyLossConfig(agg_mode="token-mean"))
    assert (a.loss_sum.item(), a.denominator.item()) == (b.loss_sum.item(), b.denominator.item()) == (
        a.loss_sum.item(), 12.0)


def test_a_dotted_path_loss_is_called_with_the_config():
    for path in (f"{HERE}:sequence_sum_loss", f"{HERE}.sequence_sum_loss"):
        cfg = policy_loss_config(path, eps_low=0.1)
        assert cfg.fn is sequence_sum_loss and cfg.name == path and cfg.eps_low == 0.1


def expected_one_of(registry) -> str:
    """The names part of an "is not registered" message, from the registry (today 'dapo', 'grpo', 'dr_grpo', 'gspo'
    for the losses, 'grpo', 'dr_grpo' for the estimators)."""
    return re.escape("expected one of " + ", ".join(repr(name) for name in registry))


@pytest.mark.parametrize("name, message", [
    ("ppo", rf"--policy-loss 'ppo' is not registered; {expected_one_of(POLICY_LOSSES)} or a dotted "
            r"path 'pkg.module:function' to fn\(log_probs, old_log_probs, advantages, mask, config"),
    ("no_such_pkg.mod:fn", r"--policy-loss 'no_such_pkg.mod:fn': cannot import module 'no_such_pkg.mod'"),
    (f"{HERE}:missing", r"--policy-loss .*has no attribute 'missing'"),
    (f"{HERE}:NOT_A_FUNCTION", r"--policy-loss .* names a int, not a function"),
    (f"{HERE}:two_arg_loss", rf"--policy-loss '{HERE}:two_arg_loss' "
                                                   r"cannot be called as fn\(log_probs, old_log_probs"),
    (f"{HERE}:tuple_loss", r"--policy-loss .* returned tuple, not a PolicyLossOutput"),
    ("", r"--policy-loss must be a non-empty string"),
], ids=["unknown", "unimportable", "no-attribute", "not-callable", "wrong-signature", "wrong-return", "empty"])
def test_policy_loss_errors_name_the_flag(name, message):
    with pytest.raises(UserError, match=message):
        policy_loss_config(name)


@pytest.mark.parametrize("name, fields, message", [
    ("grpo", dict(agg_mode="token-mean"), "--loss-agg-mode token-mean contradicts --policy-loss grpo"),
    ("gspo", dict(agg_mode="seq-mean-token-sum"), "--loss-agg-mode seq-mean-token-sum contradicts --policy-loss gspo"),
    ("dr_grpo", dict(agg_mode="seq-mean-token-sum", max_response_length=8),
     "--loss-agg-mode seq-mean-token-sum contradicts --policy-loss dr_grpo"),
    ("gspo", dict(dual_clip_c=3.0), "--clip-ratio-c 3.0 does not apply to --policy-loss gspo"),
    ("dr_grpo", dict(), r"--policy-loss dr_grpo divides by L_max: .*\(--max-response-length\)"),
], ids=["grpo-token-mean", "gspo-agg", "dr_grpo-agg", "gspo-dual-clip", "dr_grpo-no-lmax"])
def test_a_contradicting_flag_combination_names_both_flags(name, fields, message):
    with pytest.raises(UserError, match=message):
        policy_loss_config(name, **fields)


def test_a_losss_own_aggregation_may_be_given():
    assert policy_loss_config("grpo", agg_mode="seq-mean-token-mean").agg_mode == "seq-mean-token-mean"
    assert policy_loss_config("gspo", agg_mode="seq-mean-token-mean").fn is gspo_loss


# ---- a loss's metrics -------------------------------------------------------------------------------------------
def test_a_dotted_path_loss_declares_its_metrics_in_an_attribute():
    assert policy_loss_config("tests.losses:neg_adv_loss").metrics == (*TOKEN_METRICS, "neg_adv_tokens")
    # none declared: the shared token sums (what tokens-only sequence_sum_loss reports is among them)
    assert policy_loss_config(f"{HERE}:sequence_sum_loss").metrics == TOKEN_METRICS


def test_an_undeclared_metric_is_an_error_at_start_up():
    with pytest.raises(UserError, match=re.escape("--policy-loss 'tests.losses:undeclared_metric_loss' returned "
                                                  "metrics ['neg_adv_tokens'] that it does not declare")):
        policy_loss_config("tests.losses:undeclared_metric_loss")


def bad_metrics_loss(log_probs, old_log_probs, advantages, mask, config, *, entropy=None, is_weights=None):
    return neg_adv_loss(log_probs, old_log_probs, advantages, mask, config, entropy=entropy, is_weights=is_weights)


@pytest.mark.parametrize("metrics, message", [
    ("neg_adv_tokens", "they must be a tuple of metric names"),
    (("pg_loss", "neg_adv_tokens"), "the names must be distinct and include 'tokens'"),
    (("tokens", "tokens"), "the names must be distinct"),
], ids=["a-string", "no-tokens", "twice"])
def test_a_malformed_declaration_is_an_error_naming_the_flag(monkeypatch, metrics, message):
    monkeypatch.setattr(bad_metrics_loss, "metrics", metrics, raising=False)
    with pytest.raises(UserError, match=rf"^--policy-loss '{HERE}:bad_metrics_loss': .*"
                                        rf"{re.escape(message)}"):
        policy_loss_config(f"{HERE}:bad_metrics_loss")


def test_a_metric_named_like_the_train_steps_own_is_refused(monkeypatch):
    monkeypatch.setattr(bad_metrics_loss, "metrics", ("tokens", "lr"), raising=False)
    loss = PolicyLossConfig(name="mine", fn=bad_metrics_loss)
    with pytest.raises(ValueError, match=r"--policy-loss 'mine' declares metrics \['lr'\], which the train step "
                                         r"reports itself"):
        ActorConfig(loss=loss)


def test_a_config_without_its_function_is_refused():
    with pytest.raises(ValueError, match="policy_loss_config"):
        PolicyLossConfig(name="gspo")


# ---- advantage estimators --------------------------------------------------------------------------------------
REWARDS = [1.0, -1.0, -1.0, 1.0, 1.0, 0.5, 0.0]
GROUPS = ["a", "a", "a", "a", "b", "b", "b"]


def test_grpo_estimator_is_todays_group_normalisation():
    assert get_advantage_estimator() is grpo_advantages
    got = grpo_advantages(torch.tensor(REWARDS, dtype=torch.float64), GROUPS)
    assert torch.equal(got, group_advantages(REWARDS, GROUPS))
    # written out: group a mean 0, unbiased std sqrt(4/3); group b mean 0.5, unbiased std 0.5
    std_a = (4 / 3) ** 0.5
    want = [1 / (std_a + 1e-6), -1 / (std_a + 1e-6), -1 / (std_a + 1e-6), 1 / (std_a + 1e-6),
            0.5 / (0.5 + 1e-6), 0.0, -0.5 / (0.5 + 1e-6)]
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_dr_grpo_estimator_only_centres():
    assert get_advantage_estimator("dr_grpo") is dr_grpo_advantages
    got = dr_grpo_advantages(torch.tensor(REWARDS, dtype=torch.float64), GROUPS)
    assert got.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0, 0.5, 0.0, -0.5])


def test_a_dotted_path_estimator():
    fn = get_advantage_estimator(f"{HERE}:centred_by_max")
    assert fn is centred_by_max
    assert fn(torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64), [0, 0, 1]).tolist() == [0.0, -1.0, 0.0]


@pytest.mark.parametrize("name, message", [
    ("rloo", rf"--advantage-estimator 'rloo' is not registered; {expected_one_of(ADVANTAGE_ESTIMATORS)} or a dotted "
             r"path 'pkg.module:function' to fn\(rewards: Tensor\[N\], group_ids: Sequence\[Hashable\]\) -> "
             r"Tensor\[N\]"),
    ("no_such_pkg:fn", r"--advantage-estimator 'no_such_pkg:fn': cannot import module 'no_such_pkg'"),
    (f"{HERE}:two_arg_loss", r"--advantage-estimator .* failed on 4 trial rewards"),
    (f"{HERE}:sequence_sum_loss", r"--advantage-estimator .* cannot be called as fn\(rewards"),
    (f"{HERE}:list_estimator", r"--advantage-estimator .* returned list for 4 rewards"),
], ids=["unknown", "unimportable", "fails", "wrong-signature", "wrong-return"])
def test_advantage_estimator_errors_name_the_flag(name, message):
    with pytest.raises(UserError, match=message):
        get_advantage_estimator(name)


# ---- flags ---------------------------------------------------------------------------------------------------------
BASE = ["--hf-checkpoint", "/m", "--prompt-data", "/d", "--num-steps", "1", "--max-response-length", "12",
        "--overlong-buffer-length", "4"]


def test_flags_build_the_chosen_functions_into_the_configs():
    actor, _, trainer = build_configs(build_parser().parse_args(BASE))
    assert actor.loss.fn is policy_loss and actor.loss.agg_mode is None
    assert trainer.advantage_estimator is grpo_advantages
    args = build_parser().parse_args(BASE + ["--policy-loss", "gspo", "--advantage-estimator", "dr_grpo",
                                             "--clip-ratio-low", "3e-4", "--clip-ratio-high", "4e-4"])
    actor, _, trainer = build_configs(args)
    assert actor.loss.fn is gspo_loss and (actor.loss.eps_low, actor.loss.eps_high) == (3e-4, 4e-4)
    assert trainer.advantage_estimator is dr_grpo_advantages
    actor, _, _ = build_configs(build_parser().parse_args(BASE + ["--policy-loss", "dr_grpo"]))
    assert actor.loss.max_response_length == 12
    with pytest.raises(UserError, match="--loss-agg-mode token-mean contradicts --policy-loss grpo"):
        build_configs(build_parser().parse_args(BASE + ["--policy-loss", "grpo", "--loss-agg-mode", "token-mean"]))


def _flat(text: str) -> str:
    """`text` on one line, single spaces, no space after a hyphen."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def test_help_gives_the_signatures():
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--help"], cwd=REPO, capture_output=True,
                         text=True, check=True, env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"}).stdout
    flat = _flat(out)  # argparse wraps at hyphens too: "--max-response-length" may come back as "...- length"
    assert "--policy-loss NAME|pkg.mod:fn" in flat and "--advantage-estimator NAME|pkg.mod:fn" in flat
    assert ("fn(log_probs, old_log_probs, advantages, mask, config: PolicyLossConfig, *, entropy=None, "
            "is_weights=None) -> PolicyLossOutput(loss_sum, denominator, metrics)") in flat
    assert "fn(rewards: Tensor[N], group_ids: Sequence[Hashable]) -> Tensor[N]" in flat
    # generated from the registries: every registered name with its own description, and a dotted path's metrics
    assert _flat(f"--policy-loss NAME|pkg.mod:fn policy loss: {POLICY_LOSSES.describe()}, or a dotted path") in flat
    assert _flat(f"--advantage-estimator NAME|pkg.mod:fn advantage per response: {ADVANTAGE_ESTIMATORS.describe()}, "
                 "or a dotted path") in flat
    assert "dapo (token-mean over the mini-batch, aggregation --loss-agg-mode), cispo (" in flat
    assert f"named in the function's `metrics` attribute (a tuple; default: {', '.join(TOKEN_METRICS)})" in flat


# ---- the registry ----------------------------------------------------------------------------------------------------
@pytest.fixture
def plugin_package(tmp_path, monkeypatch):
    """A package `plugins_under_test` with a Registry in `base` and two modules registering into it, one of them
    imported by the package's __init__."""
    pkg = tmp_path / "plugins_under_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from plugins_under_test import zeta\n")
    (pkg / "base.py").write_text("from megatron_dapo.dotted_path import Registry\n"
                                 "REG = Registry('--thing', 'fn(x) -> y', 'plugins_under_test')\n")
    (pkg / "alpha.py").write_text("from plugins_under_test.base import REG\n"
                                  "@REG.register('one', help='the first')\ndef one(x):\n    return x\n")
    (pkg / "zeta.py").write_text("from plugins_under_test.base import REG\n"
                                 "@REG.register('two')\ndef two(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m == "plugins_under_test" or m.startswith("plugins_under_test.")]:
        del sys.modules[name]


def test_a_registry_imports_its_package_on_the_first_read(plugin_package):
    from plugins_under_test.base import REG

    # the package's __init__ ran first (zeta), the module it does not import (alpha) is found on the first read
    assert list(REG) == ["two", "one"] and REG["one"](3) == 3 and len(REG) == 2
    assert REG.describe() == "two, one (the first)"
    assert REG.resolve(" one ") is REG["one"] and REG.resolve("plugins_under_test.zeta:two")(2) == 4
    with pytest.raises(UserError, match=r"--thing 'three' is not registered; expected one of 'two', 'one' or a dotted "
                                        r"path 'pkg.module:function' to fn\(x\) -> y"):
        REG.resolve("three")


def test_a_name_registered_twice_or_not_a_word_is_refused():
    reg = Registry("--thing", "fn(x)", "megatron_dapo.algorithm")
    reg.register("one")(len)
    with pytest.raises(ValueError, match=r"--thing 'one' is registered twice: builtins:len and builtins:abs"):
        reg.register("one")(abs)
    for bad in ("pkg.mod", "mod:fn", "", "two words"):
        with pytest.raises(ValueError, match="a name is one word without '.' or ':'"):
            reg.register(bad)
