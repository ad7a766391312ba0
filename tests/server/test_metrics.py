"""/metrics reports the cache's cost from the same formula as `kvserve memory` and the sizing."""

from kvserve.cli import memory_report
from kvserve.kv.formats import kv_format
from tests.server.conftest import start
from tests.server.test_openai_client import _metric


def test_kv_bytes_in_metrics_match_memory_and_sizing(stories, stories_path):
    with start(stories, "stories260K", None, num_blocks=40, kv_cache_dtype="int4", block_size=16) as server:
        per_token = _metric(server, "kvserve_kv_cache_bytes_per_token")
        assert per_token == kv_format("int4").bytes_per_token(stories.config, 16)
        assert per_token == memory_report(stories_path, 512, 1, "int4", 16)["bytes_per_token"]
        plan = server.engine.plan
        assert _metric(server, "kvserve_kv_cache_bytes") == plan.total_bytes
        assert _metric(server, "kvserve_kv_cache_block_bytes") == plan.block_bytes == 16 * per_token
        assert server.engine.storage.nbytes + plan.fixed_bytes == plan.total_bytes


def test_a_windowed_cache_reports_what_a_sequence_holds(stories, stories_path):
    import httpx
    with start(stories, "stories260K", None, num_blocks=64, sliding_window=64, attention_sinks=4,
               block_size=16) as server:
        plan = server.engine.plan
        # a 512-token sequence holds the sinks' block and 64 recent tokens' 5 blocks, in every layer
        assert _metric(server, "kvserve_kv_cache_sequence_bytes_max") == 6 * plan.block_bytes
        assert memory_report(stories_path, 512, 1, "auto", 16, sliding_window=64,
                             attention_sinks=4)["sequence_bytes"] == 6 * plan.block_bytes
        r = httpx.post(server.url + "/v1/completions", json={"model": "stories260K", "prompt": "Once upon a time",
                                                              "max_tokens": 600, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 600  # past the 512 context
        text = httpx.get(server.url + "/metrics").text
        assert 'kvserve_kv_cache_group_blocks{group="0",kind="sliding",sinks="4",window="64"} 0.0' in text
