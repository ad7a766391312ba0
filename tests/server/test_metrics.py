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
