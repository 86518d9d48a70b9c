"""The architecture facts of an HF checkpoint, read once from its config.json by its model family.

Every other module (model provider, converter, weight sync, rollout) takes a `ModelArch` rather
than a raw HF config, so a field is parsed and validated in one place: the family registered under
the config's `model_type` (`models/registry.py`) parses it, and `arch.family` gives its other hooks.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from megatron_dapo.errors import UserError

if TYPE_CHECKING:
    from megatron_dapo.models.family import ModelFamily


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    """A decoder of RMSNorm, RoPE, GQA attention and SwiGLU MLPs, dense or mixture-of-experts (`num_experts`
    > 0: the layers in `moe_layers` route each token to `num_experts_per_tok` of `num_experts` SwiGLU experts);
    the family's options say the rest."""

    model_type: str
    """HF config.json model_type: the registered family (`models/registry.py`) whose hooks build the model."""
    vocab_size: int
    """Rows of the HF embedding (before any TP padding)."""
    hidden_size: int
    intermediate_size: int
    """SwiGLU inner size (gate and up projections each have this many rows)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Query groups (GQA); equals num_heads for plain multi-head attention."""
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool | None = None
    """Bias on the q/k/v projections (no other linear has one). None: the family's default."""
    qk_layernorm: bool | None = None
    """RMSNorm on each head's q and k before RoPE. None: the family's default."""
    family_options: tuple[tuple[str, Any], ...] = ()
    """Further (name, value) facts only the family's own hooks read (e.g. a rope scaling); compared on resume."""
    num_experts: int = 0
    """Routed experts per MoE layer (config.json num_experts); 0: a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """SwiGLU inner size of one expert."""
    norm_topk_prob: bool = True
    """The top-k routing weights are renormalised to sum to 1 (Qwen3-MoE's norm_topk_prob)."""
    moe_layers: tuple[int, ...] = ()
    """Global indices of the MoE layers, ascending; the other layers have a dense MLP (`intermediate_size`)."""
    router_aux_loss_coef: float = 0.0
    """config.json's load-balancing loss coefficient (HF's formula; `--moe-aux-loss-coeff` defaults from it)."""

    def __post_init__(self) -> None:
        from megatron_dapo.models.registry import family

        defaults = family(self.model_type).arch_defaults
        # a JSON round trip of to_dict() turns the pairs into lists
        object.__setattr__(self, "family_options", tuple((str(k), v) for k, v in self.family_options))
        for name in ("qkv_bias", "qk_layernorm"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, bool(defaults.get(name, False)))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        context = self.max_position_embeddings
        if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
            raise ValueError(f"max_position_embeddings must be a positive integer, got {context!r}")
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        self._check_moe()

    def _check_moe(self) -> None:
        """ValueError naming the config.json field when the MoE fields are inconsistent."""
        if self.num_experts == 0:
            if self.moe_layers or self.num_experts_per_tok or self.moe_intermediate_size:
                raise ValueError("num_experts is 0 (a dense model) but MoE fields are set")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        layers = self.moe_layers
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= self.num_layers:
            raise ValueError(f"the MoE layers {list(layers)} must be distinct, ascending layer indices in "
                             f"0..{self.num_layers - 1} (mlp_only_layers / decoder_sparse_step leave none)")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")

    @property
    def is_moe(self) -> bool:
        """Whether any layer routes tokens to experts."""
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has an MoE block (else a dense MLP)."""
        return layer in self.moe_layers

    @property
    def all_layers_moe(self) -> bool:
        """Whether every layer is MoE (megatron-core then stacks the layers in a dist checkpoint)."""
        return self.is_moe and len(self.moe_layers) == self.num_layers

    @property
    def family(self) -> ModelFamily:
        """The registered family of `model_type` (its mapping table and hooks)."""
        from megatron_dapo.models.registry import family

        return family(self.model_type)

    def option(self, name: str, default: Any = None) -> Any:
        """The value of family option `name` (`family_options`), or `default`."""
        return dict(self.family_options).get(name, default)

    def fact(self, name: str) -> Any:
        """A size or flag a mapping table names (`MappingEntry.shapes` / `requires`): the attribute `name`, else the
        family option `name` (a family's own sizes, e.g. an MLA latent rank); AttributeError when neither exists."""
        if hasattr(self, name):
            return getattr(self, name)
        options = dict(self.family_options)
        if name not in options:
            raise AttributeError(f"{name!r} is neither a ModelArch field nor a {self.model_type} family option")
        return options[name]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_parameters(self, *, active: bool = False) -> int:
        """Parameter count of the HF model (what `hf.parameters()` holds), read off the family's name table: every
        tensor the arch has (`MappingEntry.present`) times the layers that hold it, buffers left out
        (`MappingEntry.buffer`), an untied head counted beside the embedding.

        active: count only the experts one token runs (num_experts_per_tok of each MoE layer's routed experts; shared
        experts always run), e.g. 3.3B of Qwen3-30B-A3B's 30.5B."""
        experts = self.num_experts_per_tok if active else self.num_experts
        n = 0
        for entry in self.family.mapping:
            if not entry.present(self) or entry.buffer or (entry.tied_hf and self.tie_word_embeddings):
                continue
            copies = sum(entry.in_layer(self, i) for i in range(self.num_layers)) if entry.stage == "layer" else 1
            n += copies * (experts if entry.per_expert else 1) * entry.numel(self)
        return n

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf(cls, config: Any) -> ModelArch:
        """Build from an HF config: a dict, a `PretrainedConfig`, a config.json path or its directory.

        A file that is missing raises FileNotFoundError; one that is not a JSON object, or whose fields do
        not describe a supported model, raises UserError (a ValueError) naming the file.
        """
        where = "config.json"
        if isinstance(config, (str, os.PathLike)):
            where = hf_config_path(config)
            if not os.path.isfile(where):
                raise FileNotFoundError(NO_HF_CONFIG.format(where))
            config = read_config_json(where)
        elif not isinstance(config, dict):
            config = config.to_dict()
        try:
            return cls._from_dict(config)
        except ValueError as err:
            raise UserError(f"{where}: {err}") from err

    @classmethod
    def _from_dict(cls, config: dict[str, Any]) -> ModelArch:
        from megatron_dapo.models.registry import family

        return family(config.get("model_type")).parse(config)


NO_HF_CONFIG = "no HF config at {}: pass the model directory with config.json"
"""The error of an HF model path without config.json (its path)."""


def require_arch(arch: ModelArch | None, hf_checkpoint: str) -> ModelArch:
    """The architecture parsed at start-up; its absence (--hf-checkpoint without config.json) is a UserError where
    the run first needs it (load_inputs, after rank 0 checked --load / --save; the embedded engine's build)."""
    if arch is None:
        raise UserError(f"--hf-checkpoint: {NO_HF_CONFIG.format(hf_config_path(hf_checkpoint))}")
    return arch


def hf_config_path(path: str | os.PathLike[str]) -> str:
    """config.json of an HF model directory, or `path` itself when it is not a directory."""
    path = os.fspath(path)
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def dense_decoder_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelArch fields every dense-decoder config.json spells the same way (a family's parse starts here).

    Raises ValueError naming the missing fields.
    """
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in config]
    if missing:
        raise ValueError(f"missing {missing}")
    num_heads = config["num_attention_heads"]
    rope_theta = config.get("rope_theta")
    if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
        rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
    return dict(
        model_type=config.get("model_type"),
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=config.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in `path`; UserError naming the file (and line/column or byte) when it is not one."""
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"{os.fspath(path)} is not UTF-8 text (byte offset {err.start}: {err.reason}); "
                        f"it should be the model's HF config.json") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{os.fspath(path)} is not valid JSON ({err.msg}: line {err.lineno} column {err.colno}); "
                        f"it should be the model's HF config.json") from None
    if not isinstance(config, dict):
        raise UserError(f"{os.fspath(path)} holds a JSON {type(config).__name__}, not the object of an HF config")
    return config
