"""A config dataclass field declared together with the command-line flag that sets it.

`flag_field("--tensor-model-parallel-size", default=1, type=int, help=...)` is a dataclasses.field whose metadata
holds the flag, its help and argparse's keywords (type, choices, action): the option is declared once, beside the
field and the validation it gets. `megatron_dapo.arguments` adds one flag per such field of a config and
`megatron_dapo.startup` reads them back into the config by field name; megatron-core's own configs carry their flags
the same way (`argparse_meta`). Nothing here imports argparse.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, field, fields
from typing import Any

FLAG = "megatron_dapo.flag"
"""The metadata key of a flag field: {"name": flag, "help": str | None, "argparse": {keyword: value}}."""


def flag_field(name: str, *, default: Any, help: str | None = None, **argparse_kwargs: Any) -> Any:
    """A dataclass field with `default`, set on the command line by flag `name` (argparse's `help` and keywords,
    e.g. type=int, choices=(...), action="store_true"); the flag's default is the field's."""
    if not name.startswith("--"):
        raise ValueError(f"flag_field: {name!r} must start with '--'")
    return field(default=default, metadata={FLAG: {"name": name, "help": help, "argparse": argparse_kwargs}})


def flag_fields(cls: type) -> tuple[Field, ...]:
    """The fields of dataclass `cls` declared with flag_field, in declaration order."""
    return tuple(f for f in fields(cls) if FLAG in f.metadata)


def flag_name(cls: type, field_name: str) -> str:
    """The flag that sets `cls`'s field `field_name` ("--tensor-model-parallel-size"); KeyError if it has none."""
    for f in flag_fields(cls):
        if f.name == field_name:
            return f.metadata[FLAG]["name"]
    raise KeyError(f"{cls.__name__}.{field_name} is not set by a flag")


def flag_dest(f: Field) -> str:
    """argparse's attribute name for field `f`'s flag: "--num-layers-per-virtual-pipeline-stage" ->
    "num_layers_per_virtual_pipeline_stage"."""
    return f.metadata[FLAG]["name"][2:].replace("-", "_")


def argparse_spec(f: Field) -> tuple[str, dict[str, Any]]:
    """(flag, keywords for ArgumentParser.add_argument) of flag field `f`: its help, argparse keywords and the
    field's default."""
    meta = f.metadata[FLAG]
    if f.default is MISSING:
        raise ValueError(f"flag field {f.name} ({meta['name']}) needs a default")
    kwargs = dict(meta["argparse"], default=f.default)
    if meta["help"] is not None:
        kwargs["help"] = meta["help"]
    return meta["name"], kwargs
