"""Engine options are declared once, on the config dataclasses' fields (kvserve.config.option):
the command line's flags, the flat options `LLM(...)` takes and the config tree all come from
that declaration, and a default is never written twice."""

import argparse
from dataclasses import fields

import pytest

from kvserve.cli import build_parser
from kvserve.config import DEFAULT_MODEL, EngineConfig, OptionError
from kvserve.engine.args import (ENGINE_OPTIONS, OPTIONS_BY_NAME, PARTS, add_engine_args, engine_config,
                                 engine_options)
from kvserve.server.args import SERVE_ENGINE_DEFAULTS

CONFIGS = (EngineConfig, *PARTS.values())


def engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def engine_flags(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings} - {"-h", "--help", "--model"}


def owner(o) -> type:
    """The config dataclass whose field declares the option."""
    return PARTS[o.part] if o.part else EngineConfig


def declared_default(cls: type, name: str):
    return next(f.default for f in fields(cls) if f.name == name)


def test_every_config_field_is_an_engine_option_with_a_flag_and_every_flag_is_one():
    for cls in CONFIGS:
        for f in fields(cls):
            if cls is EngineConfig and f.name in ("model", *PARTS):
                continue  # the model is named first; the parts hold options of their own
            assert "option" in f.metadata, f"{cls.__name__}.{f.name} is not declared with option(...)"
    declared = {(owner(o), o.field) for o in ENGINE_OPTIONS}
    assert declared == {(cls, f.name) for cls in CONFIGS for f in fields(cls) if "option" in f.metadata}
    flags = engine_flags(engine_parser())
    assert all(set(o.flags) <= flags for o in ENGINE_OPTIONS)
    assert flags == {s for o in ENGINE_OPTIONS for s in o.flags}


def test_every_flag_defaults_to_its_dataclass_default():
    """The parser's default is read from the field, never written beside it (a bool option's
    flag turns it off: --no-cache stores False into use_cache, whose default is True)."""
    actions = engine_parser()._option_string_actions
    for o in ENGINE_OPTIONS:
        assert actions[o.flags[0]].default == declared_default(owner(o), o.field), o.name


def test_no_flags_make_the_default_config():
    a = engine_parser().parse_args([])
    assert a.model == DEFAULT_MODEL
    assert engine_config(a.model, **engine_options(a)) == EngineConfig(model=DEFAULT_MODEL) == EngineConfig()


def test_serve_changes_only_the_defaults_it_names():
    serve = engine_options(build_parser().parse_args(["serve"]))
    generate = engine_options(build_parser().parse_args(["generate", "hi"]))
    assert {k: v for k, v in serve.items() if generate[k] != v} == SERVE_ENGINE_DEFAULTS
    assert set(SERVE_ENGINE_DEFAULTS) <= set(OPTIONS_BY_NAME)


def test_flags_that_are_not_their_options_name_convert_to_it():
    a = engine_parser().parse_args(["--kv-cache-memory", "0.25", "--no-prefix-caching", "--no-cache",
                                    "--scheduling-policy", "priority", "--swap-space", "1e6",
                                    "--trace", "t.jsonl", "--log-stats-interval", "0", "-tp", "2",
                                    "--speculative", "ngram"])
    c = engine_config(a.model, **engine_options(a))
    assert (c.cache.memory_fraction, c.cache.memory_bytes, c.cache.enable_prefix_caching, c.use_cache) == \
           (0.25, None, False, False)
    assert (c.scheduler.policy, c.cache.swap_space_bytes, c.trace_path, c.log_stats_interval_s) == \
           ("priority", 1_000_000, "t.jsonl", None)
    assert (c.parallel.tensor_parallel_size, c.speculative.method) == (2, "ngram")
    a = engine_parser().parse_args(["--kv-cache-memory", "1e9"])
    assert engine_config(**engine_options(a)).cache.memory_bytes == 10 ** 9
    with pytest.raises(OptionError) as e:
        engine_options(engine_parser().parse_args(["--log-stats-interval", "-1"]))
    assert e.value.as_flag == "--log-stats-interval must be a number of seconds >= 0, got -1.0"


@pytest.mark.parametrize("name", ["bogus", "layout", "memory_bytes", "method", "trace_path", "model_len"])
def test_an_unknown_flat_option_is_a_type_error_naming_it(name):
    """Field names that differ from their option's flat name are no options either."""
    with pytest.raises(TypeError, match=f"unknown engine option '{name}'"):
        engine_config(**{name: 1})


def test_llm_takes_exactly_the_options_the_command_line_gives(stories):
    from kvserve.engine.llm import LLM
    cli = engine_options(engine_parser().parse_args([]))
    assert set(cli) == set(OPTIONS_BY_NAME)
    options = {**cli, "num_blocks": 64}
    llm = LLM("preloaded", loaded=stories, **options)
    from kvserve.engine.llm_engine import resolve_defaults
    assert llm.engine.config == resolve_defaults(engine_config("preloaded", **options), stories)  # auto resolved
    with pytest.raises(TypeError, match="unknown engine option 'memory_bytes'"):
        LLM("preloaded", loaded=stories, memory_bytes=1 << 20)


def test_the_defaults_users_know_stay_what_they_were():
    """The defaults as the command line has always had them (a change to one is a change users
    see, made on purpose here)."""
    a = engine_parser().parse_args([])
    known = dict(dtype="auto", weight_dtype="auto", packed_activations="auto", exact=False, kv_cache_dtype="auto",
                 block_size=16, max_num_seqs=64, max_num_batched_tokens=2048, policy="fcfs",
                 preemption_mode="auto", eviction_policy="lru", swap_space=float(1 << 30), seed=0,
                 attention_backend="auto",
                 linear_backend="auto", num_speculative_tokens=4, tensor_parallel_size=1, attention_sinks=0)
    assert {k: getattr(a, k) for k in known} == known
