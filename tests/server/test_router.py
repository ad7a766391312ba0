"""Replicas behind the cache-aware router: each prefix family goes to one replica (so the hit
rate is the single engine's), outputs equal the single engine's, /metrics shows each replica
and the total, and a replica killed mid-run fails its streams at once while the survivor's
outputs stay the same."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvserve.server.router import Router, RoutingPolicy, merge_metrics
from tests.conftest import STORIES_DIR, greedy, make_llm
from tests.processes import healthy, running, wait_ready
from tests.server.conftest import RunningServer, free_port

FAMILIES = ["Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with "
            "her big red ball and her friend Tom.",
            "One day, a small bird flew over the tall green trees. The bird was looking for food for its "
            "babies in the nest.",
            "Tom had a toy car that he liked very much. Every day he took it to the park and made it go "
            "fast on the path."]
ENDINGS = [" Then", " One day", " She said", " They"]


# ---- the policy ----
def ready(router: Router, block_size: int = 4) -> Router:
    """Every replica's view as after its first (empty) events answer: it names blocks now."""
    for v in router.views:
        v.apply({"epoch": "e", "next": 0, "events": [], "snapshot": None, "block_size": block_size,
                 "namespace": ["m", "float32", "float32", None]})
    return router


FAMILY_IDS = [[1, *range(10 * f, 10 * f + 20)] for f in range(3)]  # 21 tokens: 5 full blocks of 4


def names(router: Router, family: int, ending: int, salt=None) -> list[bytes]:
    return router.block_names(FAMILY_IDS[family] + [200 + ending] * 3, salt)


def test_a_family_sticks_to_the_replica_that_saw_it():
    router = ready(Router(["http://a", "http://b"]))
    first = [router.choose(names(router, f, 0)).index for f in range(3)]
    assert len(set(first)) == 2  # new prefixes spread by load
    for ending in (1, 2, 3):
        assert [router.choose(names(router, f, ending)).index for f in range(3)] == first
    assert router.num_cache_routed == 9


def test_new_prefix_goes_to_the_least_loaded_replica():
    router = ready(Router(["http://a", "http://b", "http://c"]))
    router.replicas[0].active_blocks, router.replicas[1].active_blocks = 5, 1
    assert router.choose(names(router, 0, 0)).index == 2


def test_load_outweighs_a_short_overlap_as_the_cost_says():
    router = ready(Router(["http://a", "http://b"], RoutingPolicy(overlap_weight=1.0)))
    home = router.choose(names(router, 0, 0)).index
    request = names(router, 0, 1)  # 5 blocks, all held at home
    router.replicas[home].active_blocks = 4  # cost at home 0 + 4 < elsewhere 5 + 0
    assert router.choose(request).index == home
    router.replicas[home].active_blocks = 6  # 0 + 6 > 5 + 0
    assert router.choose(request).index == 1 - home


def test_a_dead_replica_is_never_chosen_and_forgotten():
    router = ready(Router(["http://a", "http://b"]))
    home = router.choose(names(router, 0, 0))
    router.mark_dead(home, "killed")
    assert router.views[home.index].overlap(names(router, 0, 1)) == 0
    assert all(router.choose(names(router, 0, e)).index != home.index for e in range(4))
    router.mark_dead(router.replicas[1 - home.index], "killed")
    assert router.choose(names(router, 0, 0)) is None


def test_a_prompt_shorter_than_a_block_has_no_names():
    router = ready(Router(["http://a"]))
    assert router.block_names([1, 2, 3, 4], None) == []  # the last token is always computed
    assert len(router.block_names([1, 2, 3, 4, 5], None)) == 1
    assert Router(["http://a"]).block_names([1] * 50, None) == []  # no replica answered yet


def test_metrics_are_labelled_per_replica_with_a_total():
    text = ("# HELP kvserve_x x\n# TYPE kvserve_x counter\nkvserve_x 3\n"
            "# TYPE kvserve_kv_cache_usage gauge\nkvserve_kv_cache_usage 0.5\nkvserve_y{kind=\"a\"} 1\n")
    merged = merge_metrics({0: text, 1: text.replace(" 3", " 4").replace("0.5", "0.25")})
    lines = merged.splitlines()
    assert 'kvserve_x{replica="0"} 3' in lines and 'kvserve_x{replica="1"} 4' in lines
    assert 'kvserve_x{replica="total"} 7' in lines
    assert 'kvserve_kv_cache_usage{replica="total"} 0.375' in lines  # usage: the mean
    assert 'kvserve_y{kind="a",replica="total"} 2' in lines
    assert lines.count("# HELP kvserve_x x") == 1


# ---- real replicas ----
class Replicas:
    """n `kvserve serve` processes of stories260K and the router in a thread; leaving stops the
    router, then each replica with its process group, however the test ended."""

    def __init__(self, n: int, tokenizer=None, server_args: tuple[str, ...] = ()) -> None:
        self.n, self.tokenizer, self.server_args = n, tokenizer, server_args
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Replicas":
        from kvserve.server.router import create_router_app
        self.ports = [free_port() for _ in range(self.n)]
        urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        with contextlib.ExitStack() as stack:  # a failed start stops what did start
            self.servers = [stack.enter_context(running(serve_command(p, "--num-blocks", "512", *self.server_args)))
                            for p in self.ports]
            self.procs = [s.proc for s in self.servers]
            wait_ready([(s, healthy(u)) for s, u in zip(self.servers, urls)], 120)  # started side by side
            self.router = Router(urls, tokenizer=self.tokenizer)
            app = create_router_app(self.router, health_interval_s=0.2)
            self.server = stack.enter_context(RunningServer(app, None))
            self._stack = stack.pop_all()  # all up: __exit__ stops them
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)


def serve_command(port: int, *args: str) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "kvserve")
    return [exe, "serve", "--model", str(STORIES_DIR), "--port", str(port), *args, "--log-stats-interval", "1000"]


def _complete(url: str, prompt: str, max_tokens: int = 16) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                      timeout=60)


@pytest.fixture(scope="module")
def offline(stories):
    return make_llm(stories)


def test_families_meet_their_prefix_on_one_replica(offline):
    prompts = [f + e for e in ENDINGS for f in FAMILIES]  # each family's requests come apart in time
    single_cached = sum(offline.generate(p, greedy(16))[0].num_cached_tokens for p in prompts)
    with Replicas(2, offline.engine.tokenizer) as r:
        homes: dict[str, set[str]] = {}
        cached = 0
        for p in prompts:
            got = _complete(r.server.url, p)
            assert got.status_code == 200, got.text
            body = got.json()
            want = offline.generate(p, greedy(16))[0].outputs[0].text
            assert body["choices"][0]["text"] == want
            homes.setdefault(p[:40], set()).add(got.headers["x-kvserve-replica"])
            cached += body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) or 0
        assert all(len(h) == 1 for h in homes.values())
        assert len(set.union(*homes.values())) == 2  # both replicas serve
        metrics = httpx.get(r.server.url + "/metrics").text
        assert 'replica="0"' in metrics and 'replica="1"' in metrics and 'replica="total"' in metrics
        assert 'kvserve_router_decisions_total{reason="cache"} 9' in metrics
    # each family's later requests hit its blocks as they would on one engine
    assert cached >= 0.9 * single_cached > 0


def test_killing_a_replica_fails_its_streams_and_spares_the_others(offline, stories):
    """Every stream is endless (a sliding window lets it run past the context), so the victim's
    are surely in flight when its replica dies, however fast the replicas decode; the others are
    read for a while, compared with the same window offline, and closed."""
    prompts = [f + ENDINGS[0] for f in FAMILIES] + ["A cat sat on the mat and looked at the"]
    window = ("--sliding-window", "64")
    with Replicas(2, server_args=window) as r:
        client = httpx.Client(timeout=30)
        streams = []
        for p in prompts:
            req = client.build_request("POST", r.server.url + "/v1/completions",
                                       json={"prompt": p, "max_tokens": 1_000_000, "temperature": 0, "stream": True,
                                             "ignore_eos": True, "logprobs": 0})
            resp = client.send(req, stream=True)
            lines = resp.iter_lines()
            first = next(lines)  # the stream has begun
            streams.append((p, resp, itertools.chain([first], lines)))
        victim = int(streams[0][1].headers["x-kvserve-replica"])
        os.kill(r.procs[victim].pid, signal.SIGKILL)
        t0 = time.monotonic()
        windowed = make_llm(stories, sliding_window=64)
        for p, resp, lines in streams:
            text, tokens, error = "", 0, None
            for line in lines:
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                        continue
                    choice = event["choices"][0]
                    text, tokens = text + choice["text"], tokens + len(choice["logprobs"]["tokens"])
                    if tokens >= 40 and int(resp.headers["x-kvserve-replica"]) != victim:
                        break  # a survivor streams on: enough of it is read
            resp.close()
            if int(resp.headers["x-kvserve-replica"]) == victim:
                assert error is not None and "failed mid-stream" in error
            else:
                want = windowed.generate(p, greedy(tokens, ignore_eos=True))[0].outputs[0].text
                assert error is None and text == want
        assert time.monotonic() - t0 < 60  # nothing hung on the dead replica
        # the survivor takes every new request, the dead one's families included
        for p in prompts:
            got = _complete(r.server.url, p)
            assert got.status_code == 200 and int(got.headers["x-kvserve-replica"]) != victim
            assert got.json()["choices"][0]["text"] == offline.generate(p, greedy(16))[0].outputs[0].text
        state = httpx.get(r.server.url + "/router/state").json()
        assert not state["replicas"][victim]["alive"]


def test_serve_with_data_parallel_size_starts_replicas_behind_the_router(offline):
    """`kvserve serve --data-parallel-size 2`: one endpoint, two replica processes, all gone after SIGTERM."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # its own process group: should the test fail before the SIGTERM, the replicas are stopped with it
    with running(serve_command(port, "--data-parallel-size", "2", "--num-blocks", "256"), ready=healthy(url),
                 timeout_s=120) as server:
        proc = server.proc
        assert httpx.get(url + "/health").json()["replicas_alive"] == 2
        got = _complete(url, FAMILIES[0])
        assert got.json()["choices"][0]["text"] == offline.generate(FAMILIES[0], greedy(16))[0].outputs[0].text
        metrics = httpx.get(url + "/metrics").text
        assert 'kvserve_router_replica_up{replica="1"} 1' in metrics and 'replica="total"' in metrics
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        replicas = [pid for pid in children if "resource_tracker" not in open(f"/proc/{pid}/cmdline").read()]
        assert len(replicas) == 2
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        assert proc.returncode == 0
        for pid in replicas:  # the replicas went with it (checked before leaving stops the group)
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
