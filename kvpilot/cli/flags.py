"""What every package's CLI shares: subcommand parsers, and flags generated from config dataclasses.

As vLLM registers `FrontendArgs` and `AsyncEngineArgs`, a config field becomes a flag when its metadata
carries `flag(...)`: its help, and where they differ from the field's, vLLM's flag name, aliases, choices,
metavar. The field's type gives the rest (`int | None` -> int, `list[int]` -> one or more, `bool` ->
`--x` / `--no-x`). The flag's default is the field's and nothing else's; the help shows it. `from_flags`
builds the config back from the parsed flags, and `flag_message` words a `validate()` error with the flags'
names, so a config checks itself once for the CLI and for Python callers alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any, cast

FLAG = "kvpilot.flag"  # the field metadata key


@dataclasses.dataclass(frozen=True, slots=True)
class FlagSpec:
    help: str
    name: str | None = None  # default: --field-name
    aliases: tuple[str, ...] = ()
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    unset: str | None = None  # what a None (or empty) default means, for the help


def flag(
    help: str,
    *,
    name: str | None = None,
    aliases: Sequence[str] = (),
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    unset: str | None = None,
) -> dict[str, FlagSpec]:
    """Field metadata that makes the field a flag: `field(default=16, metadata=flag("tokens per block"))`."""
    return {FLAG: FlagSpec(help, name, tuple(aliases), choices, metavar, unset)}


def add_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    handler: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    """A subcommand's parser; `kvpilot.cli.main.main` calls `handler(args)`. The first paragraph of the handler's
    docstring is the command's line in `kvpilot --help`, the rest its description. No abbreviated flags:
    a prefix that works today would break, or change meaning, when a longer flag is added."""
    summary, _, details = inspect.cleandoc(handler.__doc__ or "").partition("\n\n")
    p = subparsers.add_parser(name, help=summary, description=details or summary, allow_abbrev=False)
    p.set_defaults(handler=handler)
    return p


def add_flags(parser: argparse.ArgumentParser, config: type, title: str | None = None) -> Any:
    """One flag per `flag(...)` field of the dataclass `config`, in its own help group when titled;
    returns where they went, for the command's flags that are no field."""
    group = parser.add_argument_group(title) if title else parser
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        spec = f.metadata.get(FLAG)
        if spec is None:
            continue
        # a field without a default has its factory
        factory = cast(Callable[[], Any], f.default_factory)
        default = factory() if f.default is dataclasses.MISSING else f.default
        name = spec.name or _flag_name(f.name)
        kind = _value_type(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": _help(spec, f.name, default)}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            is_list = typing.get_origin(kind) is list
            kwargs.update(
                type=typing.get_args(kind)[0] if is_list else kind,
                choices=spec.choices,
                metavar=spec.metavar or _metavar(name, spec.choices),
                nargs="+" if is_list else None,
            )
            if is_list and default is None:
                kwargs["action"] = "extend"  # `--flag a --flag b` keeps both, as `--flag a b` does
        group.add_argument(name, *spec.aliases, **kwargs)
    return group


def from_flags(config: type, args: argparse.Namespace, **values: Any) -> Any:
    """`config` built from its flags in `args`; `values` fill its fields that are not flags."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(config) if FLAG in f.metadata}
    return config(**flags, **values)


def flag_message(exc: Exception, *configs: type) -> str:
    """`exc`'s message with each flag field's name (`num_kv_blocks`) written as its flag
    (`--num-gpu-blocks-override`). Only names with an underscore: `model` or `port` are also plain words."""
    names = {
        f.name: f.metadata[FLAG].name or _flag_name(f.name)
        for c in configs
        for f in dataclasses.fields(c)
        if FLAG in f.metadata and "_" in f.name
    }
    if not names:
        return str(exc)
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: names[m.group(1)], str(exc))


def _flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


_UnionType = type(int | None)


def _metavar(name: str, choices: Sequence[Any] | None) -> str | None:
    """From the flag, not the field: `--num-gpu-blocks-override NUM_GPU_BLOCKS_OVERRIDE`; choices show
    themselves."""
    return None if choices else name.lstrip("-").replace("-", "_").upper()


def _value_type(hint: Any) -> Any:
    """int for `int | None`; the hint itself otherwise."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, _UnionType) and len(args) == 1 else hint


def _help(spec: FlagSpec, field: str, default: Any) -> str:
    """The help with its default; argparse %-formats help strings, hence no raw % in it."""
    return _with_default(spec, field, default).replace("%", "%%")


def _with_default(spec: FlagSpec, field: str, default: Any) -> str:
    if default is None or default == []:
        return f"{spec.help} (default: {spec.unset})" if spec.unset else spec.help
    return f"{spec.help} (default {_shown(field, default)})"


def _shown(field: str, value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and field.endswith("_bytes"):
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if value and value % (1 << shift) == 0:
                return f"{value >> shift} {unit}"
    return str(value)
