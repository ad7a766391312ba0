"""The command line: figures, JSON fields, and one-line errors with a non-zero exit."""

import json
import sys

import pytest

from kvserve.cli import main
from tests.conftest import STORIES_DIR, STORIES_GOLDEN
from tests.processes import run


def run_cli(*args):
    p = run([sys.executable, "-m", "kvserve.cli", *args], timeout_s=300)  # past that, stopped with its children
    return p.returncode, p.stdout, p.stderr


def test_memory_smollm2_per_token_bytes(capsys, smollm2_path):
    for dtype, expected in (("float32", 46080), ("bf16", 23040)):
        assert main(["memory", "--model", smollm2_path, "--kv-cache-dtype", dtype, "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["bytes_per_token"] == expected == 2 * 30 * 3 * 64 * (4 if dtype == "float32" else 2)
        assert r["mha_bytes_per_token"] == expected * 3
        assert r["total_bytes"] == expected * 8192
    assert main(["memory", "--model", "SmolLM2-135M-Instruct", "--context", "1000", "--batch", "4",
                 "--kv-cache-dtype", "float32"]) == 0
    text = capsys.readouterr().out
    assert "46,080 bytes" in text and "184,320,000 bytes" in text and "MHA-equivalent" in text


def test_memory_named_configs_and_quantized_scales(capsys):
    assert main(["memory", "--model", "llama-2-7b", "--json", "--context", "4096", "--dtype", "float32"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bytes_per_token"] == 2 * 32 * 32 * 128 * 4 and r["attention"] == "MHA"
    assert main(["memory", "--model", "llama-3-8b", "--kv-cache-dtype", "int8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bytes_per_token"] == 2 * 32 * 8 * 128 * 1 + 2 * 32 * 8 * 4  # values + one fp32 scale per head vector


def test_memory_counts_what_sliding_layers_hold(capsys):
    """A hybrid's local layers hold their window: Gemma 3 1B at 32,768 tokens, 22 local layers of
    26 with a 512-token window, holds (4 * 2048 + 22 * 33) blocks of 16 tokens' worth per layer."""
    assert main(["memory", "--model", "gemma-3-1b", "--json", "--context", "32768", "--dtype", "float32"]) == 0
    r = json.loads(capsys.readouterr().out)
    per_layer_block = 2 * 1 * 256 * 4 * 16  # K and V, one KV head of 256, fp32, 16 tokens
    assert r["layers_by_kind"] == {"sliding": 22, "full": 4} and r["sliding_window"] == 512
    assert r["sequence_bytes"] == (4 * 2048 + 22 * 33) * per_layer_block
    assert r["paged_total_bytes"] == 26 * 2048 * per_layer_block
    assert main(["memory", "--model", "smollm2-135m", "--context", "8192", "--sliding-window", "1024",
                 "--attention-sinks", "4"]) == 0
    text = capsys.readouterr().out
    assert "30 sliding; window 1024 + 4 sinks" in text and "7.8x less" in text
    for args, message in ((["--sliding-window", "1024"], "config fixes"), (["--attention-sinks", "4"], "needs a sliding")):
        assert main(["memory", "--model", "gemma-3-1b" if "--sliding-window" in args else "smollm2-135m", *args]) == 2
        assert message in capsys.readouterr().err


def test_generate_json_on_stories():
    rc, out, err = run_cli("generate", "Once upon a time", "--model", str(STORIES_DIR), "--max-tokens", "30", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert ("Once upon a time" + r["text"]).startswith(STORIES_GOLDEN)
    for key in ("text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason", "ttft_s",
                "tpot_s", "tokens_per_s", "kv_cache_bytes", "cached_tokens", "kv_blocks"):
        assert key in r
    assert r["completion_tokens"] == len(r["token_ids"]) == 30 and r["finish_reason"] == "length"
    assert r["kv_blocks"] == 3 and r["kv_cache_bytes"] == 3 * 16 * 1280  # 35 tokens in 16-slot blocks


def test_generate_no_cache_streams_the_same_text():
    rc1, cached, _ = run_cli("generate", "Once upon a time", "--model", str(STORIES_DIR), "--max-tokens", "20")
    rc2, recomputed, _ = run_cli("generate", "Once upon a time", "--model", str(STORIES_DIR), "--max-tokens", "20",
                                 "--no-cache")
    assert rc1 == rc2 == 0 and cached == recomputed and cached.startswith(", there was")


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--model", "/no/such/model.gguf"], "model not found"),
    (["generate", "hi", "--model", str(STORIES_DIR), "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--model", str(STORIES_DIR), "--max-tokens", "0"], "--max-tokens must be"),
    (["generate", "word " * 600, "--model", str(STORIES_DIR)], "context holds 512"),
    (["generate", "hi", "--model", str(STORIES_DIR), "--chat"], "no chat template"),
    (["memory", "--model", "no-such-config"], "model not found"),
    (["generate", "hi", "--model", str(STORIES_DIR), "--dtype", "int3"], "unknown dtype"),
])
def test_user_errors_print_one_line(args, message):
    rc, out, err = run_cli(*args)
    assert rc == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
