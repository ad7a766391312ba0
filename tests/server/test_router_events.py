"""The router's view of each replica's cache comes from the replica's KV events: it stays equal
to the pool and the tiers below it through registrations, evictions, offloads and a restart
(from the backlog, or from a snapshot where the backlog is gone), and a request routed through
it lands on the replica holding its prefix."""

import time

import httpx
import pytest

from kvserve.engine.kv_events import KVEventLog
from kvserve.server.kv_events_api import events_answer
from kvserve.server.kv_view import ReplicaBlocks
from kvserve.server.router import Router, create_router_app
from tests.conftest import greedy, make_engine, run_collecting_logits
from tests.engine.test_offload import fillers, prompt_of
from tests.server.conftest import RunningServer, start


def follow(view: ReplicaBlocks, engine) -> None:
    """What the router's feed does, without HTTP: apply answers until the view is current."""
    while True:
        answer = events_answer(engine, view.cursor)
        view.apply(answer)
        if view.cursor == engine.kv_events.next_seq and answer["epoch"] == view.epoch:
            return


def assert_view_equals(view: ReplicaBlocks, engine) -> None:
    engine.check_integrity()  # the tiers' writer is idle: every event of theirs is logged
    follow(view, engine)
    pool = {b.block_hash for b in engine.kv.pool.blocks if b.block_hash is not None}
    assert view.names_in("GPU") == pool
    tiers = {t.medium: set(t.names()) for t in engine.tiers.tiers} if engine.tiers is not None else {}
    assert view.names_in("CPU") == tiers.get("CPU", set())
    assert view.names_in("DISK") == tiers.get("DISK", set())


def test_events_keep_the_view_equal_to_the_pool_and_its_tiers(stories, tmp_path):
    tok = stories.tokenizer
    block_bytes = 5 * 2 * 16 * 4 * 8 * 4  # stories260K: 5 layers of K and V, 16 tokens, 4 KV heads of 8 fp32
    engine = make_engine(stories, num_blocks=24, block_size=16, kv_cache_host_bytes=6 * block_bytes,
                         kv_cache_dir=str(tmp_path), kv_cache_disk_bytes=1 << 20)
    assert engine.plan.block_bytes == block_bytes
    view = ReplicaBlocks()
    for p in [prompt_of(tok), *fillers(tok), prompt_of(tok), prompt_of(tok, 120, " Then")]:
        run_collecting_logits(engine, [p], greedy(4))
        assert_view_equals(view, engine)
    counts = view.counts()
    assert counts["GPU"] > 0 and 0 < counts["CPU"] < counts["DISK"]  # the host tier is the smaller
    engine.close()  # the pool written down: a new engine on the directory announces what it keeps
    restarted = make_engine(stories, num_blocks=24, block_size=16, kv_cache_dir=str(tmp_path),
                            kv_cache_disk_bytes=1 << 20)
    assert_view_equals(view, restarted)
    assert view.counts()["DISK"] == len(restarted.tiers.tiers[0]) > 0
    run_collecting_logits(restarted, [prompt_of(tok)], greedy(4))
    assert_view_equals(view, restarted)
    restarted.kv.reset_prefix_cache()  # new weights: every block, in every tier, is gone
    assert_view_equals(view, restarted)
    assert view.held == {}
    restarted.close()


def test_a_view_too_far_behind_resynchronizes_from_a_snapshot(stories):
    engine = make_engine(stories, num_blocks=24, block_size=16)
    engine.kv_events = KVEventLog(max_backlog=4)  # the pool's events go to a tiny backlog
    from kvserve.engine.kv_events import watch_pool
    watch_pool(engine.kv.pool, engine.kv_events, engine.plan.block_size)
    view = ReplicaBlocks()
    run_collecting_logits(engine, [prompt_of(stories.tokenizer)], greedy(4))
    answer = events_answer(engine, 0)
    assert answer["snapshot"] is not None
    view.apply(answer)
    assert_view_equals(view, engine)
    restarted = make_engine(stories, num_blocks=24, block_size=16)  # another epoch, numbered from 0 again
    run_collecting_logits(restarted, [prompt_of(stories.tokenizer, 60, " Tom")], greedy(4))
    assert_view_equals(view, restarted)


@pytest.fixture(scope="module")
def routed(stories):
    """Two replicas in this process and a router over them, with the model's tokenizer."""
    with start(stories, "stories260K", num_blocks=256) as a, start(stories, "stories260K", num_blocks=256) as b:
        router = Router([a.url, b.url], tokenizer=stories.tokenizer)
        with RunningServer(create_router_app(router, health_interval_s=0.2), None) as front:
            yield router, (a, b), front


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the router's view did not catch up"
        time.sleep(0.05)


def pool_names(server) -> set:
    return {b.block_hash for b in server.engine.kv.pool.blocks if b.block_hash is not None}


def test_a_request_lands_where_its_prefix_is(routed):
    router, replicas, front = routed
    prefixes = ["Once upon a time, there was a little girl named Lily. She loved to play outside " * 3,
                "The big brown dog ran to the park with a red ball in his mouth and barked " * 3]
    for home, prefix in ((1, prefixes[0]), (0, prefixes[1])):
        direct = httpx.post(replicas[home].url + "/v1/completions", timeout=60,
                            json={"prompt": prefix + " Then", "max_tokens": 2, "temperature": 0})
        assert direct.status_code == 200, direct.text
        replicas[home].wait_idle()
        wait_for(lambda: router.views[home].names_in("GPU") == pool_names(replicas[home]))
        got = httpx.post(front.url + "/v1/completions", timeout=60,
                         json={"prompt": prefix + " One day", "max_tokens": 2, "temperature": 0})
        assert got.status_code == 200, got.text
        assert got.headers["x-kvserve-replica"] == str(home)
        assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    for i, server in enumerate(replicas):  # the views end equal to both pools
        server.wait_idle()
        wait_for(lambda: router.views[i].names_in("GPU") == pool_names(server))
    state = httpx.get(front.url + "/router/state", timeout=10).json()
    assert state["cache_routed"] == 2 and all(r["blocks"]["GPU"] > 0 for r in state["replicas"])


def test_the_events_endpoint_long_polls_and_checks_its_arguments(routed):
    _, (a, _), _ = routed
    first = httpx.get(a.url + "/v1/kv/events", params={"since": 0}, timeout=10).json()
    assert first["block_size"] == 16 and first["namespace"] == list(a.engine.kv.namespace)
    t0 = time.monotonic()
    later = httpx.get(a.url + "/v1/kv/events", params={"since": first["next"], "timeout_s": 0.5}, timeout=10)
    assert later.status_code == 200 and later.json()["events"] == [] and time.monotonic() - t0 >= 0.4
    for bad in ({"since": -1}, {"timeout_s": 31}, {"since": "x"}):
        assert httpx.get(a.url + "/v1/kv/events", params=bad, timeout=10).status_code in (400, 422)
