"""Engine options, shared by every front end: the command line's flags, the flat keyword
options `LLM(...)` and `LLMEngine.from_options` take, and the config tree both turn into.

Each option is declared once, on its config dataclass field in kvserve/config.py, for example

    block_size: int = option(16)
    memory_bytes: Optional[int] = option(None, "bytes for the KV cache, or a fraction (0, 1] of free
        device memory", name="kv_cache_memory", flag_type=float, from_flag=kv_memory_bytes)

The field is the option's type and default (and `__post_init__` its validation); the metadata is
its help, choices, flat name, flag and the flag's conversion. This module reads those fields into
ENGINE_OPTIONS and builds the rest from them, so no option is listed, and no default written, here:

    argparse Namespace --engine_options()--> {"block_size": 16, ...} --engine_config()--> EngineConfig
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, is_dataclass
from typing import (Any, Iterator, Mapping, Optional, Sequence, Type, TypeVar, Union, get_args, get_origin,
                    get_type_hints)

from kvserve.config import DEFAULT_MODEL, EngineConfig, FlagConversion

T = TypeVar("T")


@dataclass(frozen=True)
class EngineOption:
    """One engine option, as its config field declares it (`kvserve.config.option`)."""

    name: str  # flat, as LLM(...) takes it: "kv_cache_memory"
    part: Optional[str]  # the EngineConfig field holding its config ("cache"); None: EngineConfig's own
    field: str  # the field it sets: "memory_bytes"
    kind: type  # the field's type: int, float, str or bool (Optional taken off)
    default: Any
    flags: tuple[str, ...]  # ("--kv-cache-memory",); a flag two options share is parsed once
    help: Optional[str]
    choices: Optional[tuple[str, ...]]
    metavar: Optional[str]
    flag_type: type  # what the flag parses (the field's type unless declared)
    from_flag: Optional[FlagConversion]  # (flag_name, the parsed value) -> the option's value
    nargs: Optional[str] = None  # argparse's, for a flag taking several values

    @property
    def flag_name(self) -> str:
        """The option as its flag names it, as OptionError takes it: --log-stats-interval is
        'log_stats_interval' (the flat name is log_stats_interval_s)."""
        return self.flags[0].lstrip("-").replace("-", "_")


def _options_of(cls: type, part: Optional[str]) -> Iterator[EngineOption]:
    hints = get_type_hints(cls)
    for f in fields(cls):
        spec = f.metadata.get("option")
        if spec is None:
            continue
        name, kind = spec["name"] or f.name, _without_none(hints[f.name])
        flags = spec["flags"] or ("--" + name.replace("_", "-"),)
        yield EngineOption(name, part, f.name, kind, f.default, flags, spec["help"], spec["choices"],
                           spec["metavar"], spec["flag_type"] or kind, spec["from_flag"], spec.get("nargs"))


def _without_none(hint: Any) -> type:
    """Optional[int] -> int."""
    args = [a for a in get_args(hint) if a is not type(None)]
    return args[0] if get_origin(hint) is Union and len(args) == 1 else hint


def _flag_dests(options: Sequence[EngineOption]) -> dict[str, str]:
    """Where each flag's value lands in the Namespace: the flat name of the first option declaring it."""
    dests: dict[str, str] = {}
    for o in options:
        dests.setdefault(o.flags[0], o.name)
    return dests


_HINTS = get_type_hints(EngineConfig)
# The configs EngineConfig holds, by its field's name: {"cache": CacheConfig, ...}
PARTS: dict[str, type] = {f.name: _HINTS[f.name] for f in fields(EngineConfig)
                          if is_dataclass(_HINTS[f.name])}
ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    *_options_of(EngineConfig, None), *(o for part, cls in PARTS.items() for o in _options_of(cls, part)))
OPTIONS_BY_NAME: dict[str, EngineOption] = {o.name: o for o in ENGINE_OPTIONS}
FLAG_DESTS = _flag_dests(ENGINE_OPTIONS)


def engine_config(model: str = DEFAULT_MODEL, **options: Any) -> EngineConfig:
    """Flat keyword options (as the CLI and `LLM(...)` take them) -> the config tree; an unknown
    option is a TypeError naming it."""
    own: dict[str, Any] = {}  # EngineConfig's own fields
    parts: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
    for name, value in options.items():
        o = OPTIONS_BY_NAME.get(name)
        if o is None:
            raise TypeError(f"unknown engine option {name!r}")
        (own if o.part is None else parts[o.part])[o.field] = value
    return EngineConfig(model=model, **{part: PARTS[part](**given) for part, given in parts.items()}, **own)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--model and the flag of every engine option."""
    g = p.add_argument_group("model and cache")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="GGUF file, llama2.c checkpoint or directory, Hugging Face directory or hub id")
    add_option_flags(g, [o.name for o in ENGINE_OPTIONS])


def add_option_flags(g: Any, names: Sequence[str], helps: Optional[Mapping[str, str]] = None) -> None:
    """The flags of the named engine options, worded as `helps` says where a command has its own
    words for one (kvserve memory); g is a parser or an argument group."""
    added: set[str] = set()
    for name in names:
        # a flag two options share is parsed as its first declarer's: --kv-cache-memory as
        # kv_cache_memory, which kv_cache_memory_fraction then reads too
        o = OPTIONS_BY_NAME[FLAG_DESTS[OPTIONS_BY_NAME[name].flags[0]]]
        if o.name in added:
            continue
        added.add(o.name)
        kw: dict[str, Any] = dict(dest=o.name, default=o.default, help=(helps or {}).get(o.name, o.help))
        if o.kind is bool:  # the flag sets the opposite of the default: --no-cache
            kw["action"] = "store_false" if o.default else "store_true"
        else:
            kw.update(type=o.flag_type, choices=o.choices,
                      metavar=o.metavar or (None if o.choices else o.flag_name.upper()))
            if o.nargs is not None:
                kw["nargs"] = o.nargs
        g.add_argument(*o.flags, **kw)


def engine_options(a: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as the flat options `engine_config` takes (the model apart)."""
    options: dict[str, Any] = {}
    for o in ENGINE_OPTIONS:
        value = getattr(a, FLAG_DESTS[o.flags[0]])
        options[o.name] = o.from_flag(o.flag_name, value) if o.from_flag else value
    return options


def options_from(cls: Type[T], a: argparse.Namespace) -> T:
    """A typed options dataclass from the parsed arguments of the same names."""
    return cls(**{f.name: getattr(a, f.name) for f in fields(cls)})  # type: ignore[arg-type]
