"""GET /v1/kv/state: the cache as data, one instant's, consistent with itself, with the engine's
own invariants (check_integrity's: every reference count is the number of tables holding the
block) and with /metrics; behind the API key like the rest of /v1."""

import re
import threading
from collections import Counter

import httpx

from tests.server.conftest import API_KEY, start

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def state(server):
    r = httpx.get(server.url + "/v1/kv/state", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def check(s):
    """What check_integrity proves of the engine, proved of the state it reported."""
    t, b = s["totals"], s["blocks"]
    n = t["num_blocks"]
    assert len(b["status"]) == len(b["ref_count"]) == len(b["hashed"]) == n
    assert (b["status"].count("f"), b["status"].count("c"), b["status"].count("u")) == (t["free"], t["cached"], t["used"])
    assert abs(t["usage"] - t["used"] / n) < 1e-12
    refs = Counter(x for r in s["requests"] if r["status"] == "running" for table in r["tables"] for x in table
                   if x != s["null_block"])
    assert [refs.get(i, 0) for i in range(n)] == b["ref_count"]
    for i in range(n):
        assert (b["status"][i] == "u") == (b["ref_count"][i] > 0)
        assert b["status"][i] != "c" or b["hashed"][i] == "1"
        assert b["status"][i] != "f" or b["hashed"][i] == "0"
    bs = s["block_size"]
    for r in s["requests"]:
        held = sum(x != s["null_block"] for table in r["tables"] for x in table)
        assert r["blocks_held"] == held and r["bytes_held"] == held * s["block_bytes"]
        if r["status"] == "running":
            assert all(len(table) * bs >= r["computed_tokens"] for table in r["tables"])
        if r["status"] in ("waiting", "preempted"):
            assert held == 0
    assert t["num_running"] == sum(r["status"] == "running" for r in s["requests"])


def metrics(server):
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {k: float(v) for k, v in re.findall(r"^(kvserve_\w+) ([-0-9.e+]+)$", text, re.M)}


def test_state_under_64_concurrent_streams_stays_consistent(stories):
    with start(stories, "stories260K", API_KEY, num_blocks=160, max_num_seqs=64, max_waiting=256,
               preemption_mode="swap") as server:
        assert httpx.get(server.url + "/v1/kv/state", timeout=30).status_code == 401
        prefix = "Once upon a time, there was a little girl named Lily. She loved to play outside. "
        results = []

        def stream(i):
            with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=120, json={
                    "prompt": prefix + f"Story {i}:", "max_tokens": 48 + i, "temperature": 0.8, "seed": i,
                    "stream": True, "ignore_eos": True}) as r:
                results.append((r.status_code, sum(1 for line in r.iter_lines() if line.startswith("data: {"))))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(64)]
        for th in threads:
            th.start()
        seen_running, seen_shared, seen_swapped, snapshots = 0, 0, 0, 0
        while any(th.is_alive() for th in threads):
            s = state(server)
            check(s)
            snapshots += 1
            seen_running = max(seen_running, s["totals"]["num_running"])
            seen_shared = max(seen_shared, sum(x > 1 for x in s["blocks"]["ref_count"]))
            seen_swapped += any(r["status"] == "swapped" and r["blocks_held"] for r in s["requests"])
        for th in threads:
            th.join()
        assert [code for code, _ in results] == [200] * 64 and all(n > 1 for _, n in results)
        assert snapshots > 5 and seen_running > 8 and seen_shared > 0  # a shared prefix, really shared
        server.wait_idle()
        s, m = state(server), metrics(server)
        check(s)
        t = s["totals"]
        assert t["used"] == 0 and t["free"] + t["cached"] == t["num_blocks"] and not s["requests"]
        assert t["prefix_hit_rate"] > 0.5 and t["preemptions"] >= t["swaps_out"] >= t["swaps_in"] > 0
        assert seen_swapped  # a swapped request was seen, holding CPU-pool blocks
        assert m["kvserve_kv_cache_blocks_total"] == t["num_blocks"]
        assert m["kvserve_kv_cache_blocks_free"] == t["free"] + t["cached"]
        assert m["kvserve_kv_cache_blocks_cached"] == s["blocks"]["hashed"].count("1")
        assert m["kvserve_kv_cache_usage_ratio"] == t["usage"]
        assert m["kvserve_prefix_cache_hit_rate"] == t["prefix_hit_rate"]
        assert m["kvserve_num_preemptions"] == t["preemptions"] and m["kvserve_num_swaps_out"] == t["swaps_out"]
        assert m["kvserve_kv_cache_evictions"] == t["evictions"]


def test_a_request_in_the_state(stories_server):
    """While a request runs, its table is in the state with its tokens, in the order of its
    positions: block i holds tokens [i*bs, (i+1)*bs)."""
    done = threading.Event()

    def run():
        httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=60, json={
            "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True})
        done.set()

    th = threading.Thread(target=run)
    th.start()
    found = None
    while not done.is_set() and found is None:
        s = state(stories_server)
        found = next((r for r in s["requests"] if r["status"] == "running" and r["computed_tokens"] > 20), None)
    th.join()
    assert found is not None
    assert found["prompt_tokens"] == 5 and found["output_tokens"] >= found["computed_tokens"] - 5
    table = found["tables"][0]
    assert len(table) == -(-max(found["computed_tokens"], 1) // s["block_size"]) or \
        len(table) == -(-(found["computed_tokens"] + 1) // s["block_size"])
    assert len(set(table)) == len(table)


def test_dashboard_page_is_served_without_the_key(stories_server):
    r = httpx.get(stories_server.url + "/dashboard", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/kv/state" in r.text and API_KEY not in r.text
