"""Model families as plug-ins: every registered family against HF transformers, and no family named outside its folder.

Parametrized over `registry.families()`, so a new family folder gets these checks (docs/MODELS.md).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

from megatron_dapo.errors import UserError
from megatron_dapo.models import registry
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import families, family
from megatron_dapo.planner.activations import ActivationSpec
from megatron_dapo.weights.plan import hf_tensor_specs
from tests.torchrun import REPO

FAMILIES = sorted(families())
FIRST_MODULE = next(iter(registry.family_modules()))
LIBRARY = ("megatron_dapo", "checkpoint_convert")


def _hf_model(model_type: str, *, tied: bool, **overrides):
    """The family's tiny HF model (config fields `overrides` on top of its tiny config), random weights, seed 0."""
    fam = family(model_type)
    torch.manual_seed(0)
    config = fam.hf_config(**{**fam.tiny_config, **overrides}, tie_word_embeddings=tied)
    return fam.hf_causal_lm()(config).eval()


def test_every_family_module_registers_its_model_type():
    modules = registry.family_modules()
    assert len(modules) == len(families())
    for path, fam in modules.items():
        assert path == f"megatron_dapo.models.{fam.model_type}"  # one folder per family, named after its model_type
        assert families()[fam.model_type] is fam


def _family_package(root: Path, name: str, model_type: str | None, *, order: int | None = None) -> None:
    """A package root/name whose __init__ defines FAMILY: the first registered family's under `model_type` (None:
    no FAMILY)."""
    (root / name).mkdir()
    body = "" if model_type is None else (
        f"from dataclasses import replace\nfrom {FIRST_MODULE} import FAMILY as BASE\n"
        f"FAMILY = replace(BASE, model_type={model_type!r}, order={order!r})\n")
    (root / name / "__init__.py").write_text(body)


@pytest.fixture
def plugin_registry(tmp_path, monkeypatch):
    """The registry reading the family folders of a fresh package `plugins_families` under tmp_path (its caches
    emptied, restored afterwards)."""
    root = tmp_path / "plugins_families"
    root.mkdir()
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "PACKAGE", "plugins_families")
    monkeypatch.setattr(registry, "_FAMILIES", {})
    yield root
    for name in [m for m in sys.modules if m.split(".")[0] == "plugins_families"]:
        del sys.modules[name]


def test_a_family_is_found_by_its_folder_in_order(plugin_registry):
    """Found: every package defining FAMILY, the numbered ones by `order`, then the others by name; not a module
    defining FAMILY, not a package without one."""
    _family_package(plugin_registry, "zeta", "zeta_type", order=0)
    _family_package(plugin_registry, "beta", "beta_type")
    _family_package(plugin_registry, "alpha", "alpha_type")
    _family_package(plugin_registry, "gamma", "gamma_type", order=1)
    _family_package(plugin_registry, "helpers", None)
    (plugin_registry / "module.py").write_text(f"from {FIRST_MODULE} import FAMILY\n")
    assert registry.model_types() == ("zeta_type", "gamma_type", "alpha_type", "beta_type")
    assert list(registry.family_modules()) == [f"plugins_families.{n}" for n in ("zeta", "gamma", "alpha", "beta")]


def test_a_model_type_registered_twice_names_both_packages(plugin_registry):
    _family_package(plugin_registry, "first", "dup")
    _family_package(plugin_registry, "second", "dup")
    with pytest.raises(ValueError, match=r"^model_type 'dup' is registered twice \(plugins_families\.first and "
                                         r"plugins_families\.second\)$"):
        registry.families()
    assert registry._FAMILIES == {}  # nothing half-registered: the next lookup fails the same way


def test_a_family_that_is_not_a_model_family_is_refused(plugin_registry):
    (plugin_registry / "odd").mkdir()
    (plugin_registry / "odd" / "__init__.py").write_text("FAMILY = 'qwen2'\n")
    with pytest.raises(TypeError, match=r"^plugins_families\.odd\.FAMILY is a str, not a models\.family\.ModelFamily"):
        registry.families()


def test_reading_the_registry_imports_neither_megatron_core_nor_transformers():
    """Rollout and converter environments read the registry: finding and importing every family stays light."""
    code = ("import sys\nfrom megatron_dapo.models.registry import family, model_types\n"
            "assert family(model_types()[0]).model_type == model_types()[0]\n"
            "print(sorted(m for m in ('megatron.core', 'transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_mapping_names_shapes_and_count_match_the_hf_model(model_type: str, tied: bool, tmp_path: Path):
    """The family's table, read for the parsed arch, lists exactly the tensors transformers saves (on-disk names:
    an MoE's experts one by one, though transformers 5 holds them fused in memory) with their shapes."""
    _check_table_against(_hf_model(model_type, tied=tied), model_type, tmp_path)


# DeepSeek-V2-Lite / Moonlight's MLA: q_lora_rank null (one q_proj, no q latent or its norm).
@pytest.mark.skipif("deepseek_v3" not in FAMILIES, reason="the deepseek_v3 family is not registered yet")
@pytest.mark.designed_skip("the deepseek_v3 family is not registered yet")
def test_mla_without_a_q_latent_matches_the_hf_model(tmp_path: Path):
    _check_table_against(_hf_model("deepseek_v3", tied=False, q_lora_rank=None), "deepseek_v3", tmp_path)


def _check_table_against(hf, model_type: str, tmp_path: Path) -> None:
    """The family's table, read for the arch parsed from `hf`'s config, lists exactly the tensors `hf` saves with their
    shapes, and `ModelArch.num_parameters` is its parameter count."""
    from safetensors import safe_open

    arch = ModelArch.from_hf(hf.config)
    assert arch.model_type == model_type and arch.family is family(model_type)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    want = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            want |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    got = {spec.name: tuple(spec.shape) for spec in hf_tensor_specs(arch, torch.float32)}
    assert got == want
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("model_type", FAMILIES)
def test_arch_defaults_match_the_parsed_options(model_type: str):
    """A ModelArch built directly (as tests do) has the options parse gives the family's tiny config."""
    parsed = ModelArch.from_hf({**family(model_type).tiny_config, "model_type": model_type})
    fields = {k: v for k, v in parsed.to_dict().items() if k not in ("qkv_bias", "qk_layernorm")}
    assert ModelArch(**fields) == parsed


@pytest.mark.parametrize("model_type", FAMILIES)
def test_planner_spec_takes_the_family_terms(model_type: str):
    arch = ModelArch.from_hf({**family(model_type).tiny_config, "model_type": model_type})
    spec = ActivationSpec.for_arch(arch, transformer_impl="local", bytes_per_element=4)
    terms = arch.family.activation_terms(arch)
    assert {k: getattr(spec, k) for k in terms} == terms
    assert (spec.hidden, spec.q, spec.kv) == (arch.hidden_size, arch.q_size, arch.kv_size)


def test_unknown_model_type_names_the_field_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; supported: \("):
        ModelArch(model_type="gpt2", vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1,
                  num_kv_heads=1, head_dim=4)


COMMON_REJECTIONS = [
    pytest.param("hidden_act", "gelu", id="hidden_act"),
    pytest.param("use_sliding_window", True, id="sliding-window"),
    pytest.param("layer_types", ["sliding_attention"] * 4, id="layer-types"),
    pytest.param("attention_dropout", 0.1, id="attention-dropout"),
    pytest.param("mlp_bias", True, id="mlp-bias"),
]


@pytest.mark.parametrize(("field", "value"), COMMON_REJECTIONS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_rejects_values_it_would_ignore_naming_the_field(model_type, field, value):
    config = {**family(model_type).tiny_config, "model_type": model_type, field: value}
    with pytest.raises(UserError, match=rf"config.json: {field}"):
        ModelArch.from_hf(config)


@pytest.mark.parametrize(("model_type", "field", "value"), [
    pytest.param("qwen2", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, id="qwen2-yarn"),
    pytest.param("qwen2", "rope_scaling", {"rope_type": "llama3", "factor": 8.0}, id="qwen2-llama3"),
    pytest.param("qwen3", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, id="qwen3-yarn"),
    pytest.param("qwen3", "attention_bias", True, id="qwen3-attention-bias"),
    pytest.param("llama", "attention_bias", True, id="llama-attention-bias"),
])
def test_family_specific_rejections(model_type, field, value):
    config = {**family(model_type).tiny_config, "model_type": model_type, field: value}
    config.pop("rope_parameters", None)
    with pytest.raises(UserError, match=rf"config.json: {field}"):
        ModelArch.from_hf(config)


LLAMA3 = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)


@pytest.mark.parametrize(("key", "value", "match"), [
    pytest.param("low_freq_factor", 2.0, "low_freq_factor 2.0 is not supported: megatron-core 0.16.1 hard-codes 1",
                 id="low"),
    pytest.param("high_freq_factor", 8.0, "high_freq_factor 8.0 is not supported", id="high"),
    pytest.param("original_max_position_embeddings", 4096, "original_max_position_embeddings 4096", id="original"),
    pytest.param("factor", 0, "factor must be a positive number", id="factor"),
    pytest.param("rope_type", "yarn", "rope_type 'yarn' is not supported", id="yarn"),
])
def test_llama3_rope_constants_megatron_core_lacks_are_refused(key, value, match):
    config = {**family("llama").tiny_config, "model_type": "llama", "rope_parameters": {**LLAMA3, key: value}}
    with pytest.raises(UserError, match=match):
        ModelArch.from_hf(config)


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_llama3_rope_scaling_reaches_gptmodel(spelling):
    """transformers 5's rope_parameters and the older rope_scaling (with rope_theta beside it) parse alike, and the
    GPTModel built from either turns q and k at transformers' llama3 frequencies."""
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    config = {**family("llama").tiny_config, "model_type": "llama", "rope_theta": 5e5}
    config.pop("rope_parameters")
    config[spelling] = scaling if spelling == "rope_scaling" else LLAMA3
    arch = ModelArch.from_hf(config)
    assert arch.rope_theta == 5e5 and arch.option("rope_scaling_factor") == 8.0
    kwargs = arch.family.model_kwargs(arch)
    assert kwargs["rope_scaling"] is True and kwargs["rope_scaling_factor"] == 8.0
    plain = ModelArch.from_hf({**config, spelling: None})
    assert "rope_scaling" not in plain.family.model_kwargs(plain) and plain.family_options == ()
    hf_inv_freq = _hf_llama_inv_freq(LLAMA3)
    # 3 of the 8 frequencies (wavelengths > 8192 tokens at theta 5e5, head_dim 16) are divided by the factor 8
    assert (hf_inv_freq / _hf_llama_inv_freq({"rope_type": "default", "rope_theta": 5e5}) == 1 / 8).sum() == 3
    # both compute theta^(-2i/d) and the blend in fp32 with a few roundings each (<= 1 ulp apiece): 1e-6 relative
    torch.testing.assert_close(_gptmodel_inv_freq(arch), hf_inv_freq, rtol=1e-6, atol=0)


def _hf_llama_inv_freq(rope_parameters: dict) -> torch.Tensor:
    """transformers' RoPE frequencies [head_dim / 2] for the tiny llama with `rope_parameters`."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    fam = family("llama")
    return LlamaRotaryEmbedding(fam.hf_config(**{**fam.tiny_config, "rope_parameters": rope_parameters})).inv_freq


def _gptmodel_inv_freq(arch: ModelArch) -> torch.Tensor:
    """The RoPE frequencies [head_dim / 2] of the GPTModel `build_gpt_model` builds for `arch` (one process)."""
    from megatron_dapo.actor import destroy_parallel, init_parallel
    from megatron_dapo.models import build_gpt_model

    init_parallel(seed=0)
    try:
        return build_gpt_model(arch).rotary_pos_emb.inv_freq
    finally:
        destroy_parallel()


def test_qwen3_head_dim_is_read_not_derived():
    """Qwen3-32B: hidden 5120 / 64 heads is 80, but head_dim is 128 (q projection 8192 wide)."""
    config = dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                  num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128)
    arch = ModelArch.from_hf(config)
    assert (arch.head_dim, arch.q_size, arch.kv_size) == (128, 8192, 1024)
    assert arch.qk_layernorm and not arch.qkv_bias


def _names_in_code(path: Path) -> list[tuple[int, str]]:
    """Identifiers (NAME tokens: not strings, comments or docstrings) in one source file."""
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if tok.type == tokenize.NAME]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_no_library_code_names_a_family_outside_its_folder(model_type: str):
    """Style rule 18: a family is one folder (`registry.family_modules` finds it); nothing else names it."""
    folder = REPO / "megatron_dapo" / "models" / model_type
    hits = [f"{path.relative_to(REPO)}:{line} {name}"
            for root in LIBRARY for path in sorted((REPO / root).rglob("*.py")) if folder not in path.parents
            for line, name in _names_in_code(path) if model_type in name.lower()]
    assert not hits, f"{model_type} named outside {folder.relative_to(REPO)}: {hits}"


def test_a_missing_model_type_says_so():
    config = dict(family("qwen2").tiny_config)
    with pytest.raises(UserError, match=r"config.json: model_type is missing; supported: \("):
        ModelArch.from_hf(config)
