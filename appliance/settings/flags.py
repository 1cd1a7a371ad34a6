"""Command-line flags made from the settings model: one flag per setting, never a list kept
by hand, so a new setting is a flag the day it lands.

A top-level setting is `--name-with-dashes`, a setting in a section `--section.name` (the
environment's `APPLIANCE_SECTION__NAME`, the TOML file's `[section] name`). The names users of
vLLM and llama-server reach for are aliases of the same flags (`--max-model-len`,
`--gpu-memory-utilization`, ...). A flag's value is handed to the settings model as text and
validated there, so a flag, a variable and a file line are checked by the same rules.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

# Other servers' names for our settings (vLLM's, llama-server's), and the agent's short ones.
ALIASES: dict[str, tuple[str, ...]] = {
    "batch.max_model_len": ("--max-model-len",),
    "batch.max_num_seqs": ("--max-num-seqs",),
    "batch.max_num_batched_tokens": ("--max-num-batched-tokens",),
    "kv.gpu_memory_utilization": ("--gpu-memory-utilization",),
    "kv.block_size": ("--block-size",),
    "kv.prefix_caching": ("--enable-prefix-caching",),
    "planner.layout": ("--layout",),
    "cluster.head": ("--head",),
    "cluster.box": ("--box",),
    "cluster.address": ("--address",),
    "cluster.pool": ("--pool",),
    "cluster.secret_file": ("--secret-file",),
    "server.ssl_certfile": ("--ssl-certfile",),
    "server.ssl_keyfile": ("--ssl-keyfile",),
}
# Flags that set several settings at once: vLLM's one tensor-parallel size for both pools.
FANOUT: dict[str, tuple[str, ...]] = {
    "--tensor-parallel-size": ("prefill_tp", "decode_tp"),
}
_DEST = "setting:"  # argparse dests of generated flags start with it


@dataclass(frozen=True)
class Flag:
    """One setting as a flag."""

    path: tuple[str, ...]  # ("kv", "block_size")
    field: FieldInfo

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def option(self) -> str:
        return "--" + ".".join(part.replace("_", "-") for part in self.path)

    @property
    def env(self) -> str:
        return "APPLIANCE_" + "__".join(part.upper() for part in self.path)


def settings_flags(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[Flag]:
    """Every leaf setting of `model`, sections walked in their declared order."""
    for name, field in model.model_fields.items():
        section = _section_model(field.annotation)
        if section is not None:
            yield from settings_flags(section, (*prefix, name))
        else:
            yield Flag((*prefix, name), field)


def add_settings_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """Add a flag for every setting of `model` to `parser`, grouped by section."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in settings_flags(model):
        if flag.path == ("config",):
            continue  # --config is the command's own flag, before or after the subcommand
        title = flag.path[0] if len(flag.path) > 1 else "settings"
        if title not in groups:
            doc = _section_doc(model, flag.path[0]) if len(flag.path) > 1 else None
            groups[title] = parser.add_argument_group(
                f"{title} settings" if title != "settings" else title, doc
            )
        _add_flag(groups[title], flag)
    fan = parser.add_argument_group("shorthands")
    for option, paths in FANOUT.items():
        fan.add_argument(
            option,
            dest=_DEST + "+".join(paths),
            default=argparse.SUPPRESS,
            metavar="N",
            help=f"sets {' and '.join(paths)} alike (vLLM's name)",
        )


def settings_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gave, nested by section, as keyword arguments for
    `load_settings`; settings not given are absent, so the environment and file decide."""
    given: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if not dest.startswith(_DEST):
            continue
        for key in dest.removeprefix(_DEST).split("+"):
            *sections, name = key.split(".")
            target = given
            for section in sections:
                target = target.setdefault(section, {})
            target[name] = value
    return given


def _add_flag(group: argparse._ArgumentGroup, flag: Flag) -> None:
    options = [flag.option, *ALIASES.get(flag.key, ())]
    kind = _strip_optional(flag.field.annotation)
    extra: dict[str, Any] = {}
    if kind is bool:
        extra["action"] = argparse.BooleanOptionalAction
    else:
        choices = _literal_choices(kind)
        if choices:
            extra["choices"] = choices
        else:
            extra["metavar"] = flag.path[-1].upper()
        if _is_optional(flag.field.annotation):
            extra["type"] = _empty_is_none
    group.add_argument(
        *options,
        dest=_DEST + flag.key,
        default=argparse.SUPPRESS,
        help=_help(flag),
        **extra,
    )


def _help(flag: Flag) -> str:
    # '%' would be read as a format by argparse's help formatter.
    text = (flag.field.description or "").replace("%", "%%")
    default = flag.field.get_default(call_default_factory=False)
    shown = "empty" if default is None else str(default)
    if hasattr(default, "get_secret_value"):
        shown = "empty"
    return f"{text} [default: {shown}; env {flag.env}]"


def _empty_is_none(text: str) -> str | None:
    return None if text == "" else text


def _section_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _section_doc(model: type[BaseModel], name: str) -> str | None:
    section = _section_model(model.model_fields[name].annotation)
    return section.__doc__ if section is not None else None


def _is_optional(annotation: Any) -> bool:
    return _is_union(annotation) and type(None) in get_args(annotation)


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _strip_optional(annotation: Any) -> Any:
    if _is_union(annotation):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def _literal_choices(annotation: Any) -> list[str] | None:
    if get_origin(annotation) is Literal:
        return [str(arg) for arg in get_args(annotation)]
    return None
