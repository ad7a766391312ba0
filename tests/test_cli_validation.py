"""Every input checked at the edge: a broken model directory, an engine option that cannot work,
a cache larger than the machine. Each ends in one line naming the problem (the option as it was
typed, the file and its field) and exit code 2, never a traceback.

`kvserve.cli.main` runs in this process: these checks come before any model is loaded (or, for
the cache's size, right after stories260K loads in a fraction of a second)."""

import json

import pytest

from kvserve.cli import main
from tests.conftest import STORIES_DIR

STORIES = str(STORIES_DIR)
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256}


def refused(capsys, args: list[str]) -> str:
    """The one line `kvserve ARGS` printed, after checking it exited 2 with nothing else."""
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, (args, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvserve: error: "), (args, err)
    return lines[0]


@pytest.mark.parametrize("option, value, says", [
    ("--num-blocks", "0", "--num-blocks must be an integer >= 1, got 0"),
    ("--num-blocks", "-3", "--num-blocks must be an integer >= 1, got -3"),
    ("--block-size", "0", "--block-size must be an integer >= 1"),
    ("--max-num-seqs", "0", "--max-num-seqs must be an integer >= 1"),
    ("--max-num-batched-tokens", "0", "--max-num-batched-tokens must be an integer >= 1"),
    ("--max-model-len", "0", "--max-model-len must be an integer >= 1"),
    ("--max-prefill-chunk", "0", "--max-prefill-chunk must be an integer >= 1"),
    ("--swap-space", "-1", "--swap-space must be an integer >= 0, got -1"),
    ("--swap-space", "nan", "--swap-space must be a number of bytes, got nan"),
    ("--kv-cache-memory", "-5",
     "--kv-cache-memory must be bytes (> 1) or a fraction of free memory in (0, 1], got -5"),
    ("--kv-cache-memory", "0", "--kv-cache-memory must be bytes"),
    ("--kv-cache-memory", "inf", "--kv-cache-memory must be a number of bytes, got inf"),
    ("--num-speculative-tokens", "-1", "--num-speculative-tokens must be an integer >= 1, got -1"),
    ("--tensor-parallel-size", "0", "--tensor-parallel-size must be an integer >= 1"),
])
def test_engine_options_that_cannot_work_are_refused_by_their_flag(capsys, option, value, says):
    assert says in refused(capsys, ["generate", "hi", "--model", STORIES, option, value])


def test_a_cache_larger_than_the_machine_is_refused_before_it_is_allocated(capsys):
    """10**12 blocks of stories260K's 20 KiB: allocating it raised a traceback."""
    line = refused(capsys, ["generate", "hi", "--model", STORIES, "--num-blocks", str(10 ** 12)])
    assert line.startswith("kvserve: error: --num-blocks 1000000000000: the KV cache would need "
                           "20,480,000,000,020,480 bytes"), line  # (10**12 + the null block) * 16 * 1280
    assert "of memory available on cpu" in line


def test_memory_options_that_cannot_work_are_refused(capsys):
    for args, says in ((["--context", "0"], "--context must be an integer >= 1, got 0"),
                       (["--batch", "-1"], "--batch must be an integer >= 1, got -1"),
                       (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an integer >= 1"),
                       (["--block-size", "0"], "--block-size must be an integer >= 1")):
        assert says in refused(capsys, ["memory", "--model", "stories260k", *args]), args


def write_model(directory, config=None, raw=None):
    """A Hugging Face directory holding only config.json: read before any weights are."""
    directory.mkdir()
    (directory / "config.json").write_text(raw if raw is not None else json.dumps(config))
    return str(directory)


def without(*keys: str) -> dict:
    return {k: v for k, v in TINY_LLAMA.items() if k not in keys}


@pytest.mark.parametrize("config, raw, says", [
    (without("hidden_size"), None, "field 'hidden_size' is missing"),
    (without("num_hidden_layers"), None, "field 'num_hidden_layers' is missing"),
    (without("architectures", "model_type"), None,
     "neither field 'architectures' nor 'model_type' says which model"),
    ({**TINY_LLAMA, "hidden_size": "64"}, None, "field 'hidden_size' must be an integer, got '64'"),
    ({**TINY_LLAMA, "num_attention_heads": 4.5}, None, "field 'num_attention_heads' must be an integer, got 4.5"),
    ({**TINY_LLAMA, "rms_norm_eps": "small"}, None, "field 'rms_norm_eps' must be a number, got 'small'"),
    ({**TINY_LLAMA, "architectures": "LlamaForCausalLM"}, None, "field 'architectures' must be a list"),
    ({**TINY_LLAMA, "rope_parameters": {"rope_theta": "big"}}, None,
     "field 'rope_parameters.rope_theta' must be a number"),
    ({**TINY_LLAMA, "num_attention_heads": 0}, None, "num_attention_heads must be an integer >= 1, got 0"),
    (None, '{"architectures": ["LlamaForCausalLM"],', "not valid JSON (Expecting property name"),
    (None, "[1, 2, 3]", "must hold a JSON object, not list"),
])
def test_a_broken_config_json_is_named_with_its_field(capsys, tmp_path, config, raw, says):
    model = write_model(tmp_path / "model", config, raw)
    line = refused(capsys, ["memory", "--model", model])
    assert f"{model}/config.json: " in line and says in line, line


def test_a_broken_config_json_is_refused_before_the_weights_are_read(capsys, tmp_path):
    model = write_model(tmp_path / "model", without("num_hidden_layers"))
    line = refused(capsys, ["generate", "hi", "--model", model])
    assert line == f"kvserve: error: {model}/config.json: field 'num_hidden_layers' is missing"


def test_a_config_that_names_only_its_model_type_is_read(capsys, tmp_path):
    model = write_model(tmp_path / "model", without("architectures"))
    assert main(["memory", "--model", model, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["layers"], report["kv_heads"], report["head_dim"]) == (2, 2, 16)
