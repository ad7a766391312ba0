"""Tiers below the pool through the engine: a prefix the pool evicted is served from the host and
from the disk tier with the logits of a cold run and counted as cached tokens; a new engine on the
same directory starts with the old one's prefixes; another model or KV format reads nothing; a
truncated file is skipped with a warning; every tier's accounting holds after every step."""

import logging

import pytest
import torch

from kvserve.config import OptionError
from kvserve.core.block_hash import hash_full_blocks, root_hash
from kvserve.core.kv_cache_manager import block_name
from kvserve.core.retention import RetentionRange
from tests.conftest import greedy, make_engine, run_collecting_logits
from tests.engine.test_prefix_caching import long_prompt

POOL = dict(num_blocks=24, block_size=16)  # a 200-token prompt takes 13 of them


def prompt_of(tok, n=200, tail=" She"):
    return long_prompt(tok, n, tail)


def fillers(tok):
    """Prompts that share nothing with prompt_of and together need the whole pool."""
    return [tok.encode(f"Tom {i} went to the shop to buy a red ball and a blue hat. " * 7)[:180] for i in range(3)]


def run(engine, prompt):
    outs, logits = run_collecting_logits(engine, [prompt], greedy(8))
    return outs[0], next(iter(logits.values()))


def evict(engine, tok):
    for p in fillers(tok):
        run(engine, p)


def in_pool(engine, prompt):
    """How many of the prompt's full blocks the pool still holds, from the start."""
    kv = engine.kv
    parent, n = root_hash(*kv.namespace, None), 0
    for i, h in enumerate(hash_full_blocks(parent, prompt, kv.block_size)):
        tokens = tuple(prompt[i * kv.block_size:(i + 1) * kv.block_size])
        if kv.pool.lookup(block_name(h, 0), block_name(parent, 0), tokens) is None:
            break
        parent, n = h, n + 1
    return n


@pytest.fixture(scope="module")
def cold(stories):
    """The prompt's output and logits with no cache to hit."""
    return run(make_engine(stories, **POOL, enable_prefix_caching=False), prompt_of(stories.tokenizer))


def assert_same(hit, cold):
    (out, logits), (cold_out, cold_logits) = hit, cold
    assert out.outputs[0].token_ids == cold_out.outputs[0].token_ids
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(logits, cold_logits))


@pytest.mark.parametrize("tiers", [dict(kv_cache_host_bytes=1 << 20), dict(kv_cache_disk_bytes=1 << 20)])
def test_evicted_prefix_is_served_from_a_tier_as_cached_tokens(stories, cold, tmp_path, tiers):
    tok = stories.tokenizer
    engine = make_engine(stories, **POOL, **tiers, kv_cache_dir=str(tmp_path) if "kv_cache_disk_bytes" in tiers else None)
    prompt = prompt_of(tok)
    first = run(engine, prompt)
    assert first[0].num_cached_tokens == 0
    evict(engine, tok)
    assert in_pool(engine, prompt) == 0, "the fillers should have evicted the whole prefix"
    again = run(engine, prompt)
    assert again[0].num_cached_tokens == 192  # 12 full blocks; the last token is always computed
    assert_same(again, cold)
    (medium,) = engine.tiers.stats.tiers
    assert engine.tiers.stats.tiers[medium].num_hit_blocks == 12
    engine.close()


def test_a_new_engine_on_the_same_directory_serves_the_prefix_as_cached(stories, cold, tmp_path):
    tok = stories.tokenizer
    prompt = prompt_of(tok)
    engine = make_engine(stories, **POOL, kv_cache_dir=str(tmp_path))
    run(engine, prompt)
    engine.close()  # the pool's blocks are written down at shutdown
    restarted = make_engine(stories, **POOL, kv_cache_dir=str(tmp_path))
    hit = run(restarted, prompt)
    assert hit[0].num_cached_tokens == 192
    assert_same(hit, cold)
    assert restarted.tiers.stats.tiers["DISK"].num_hit_blocks == 12
    restarted.close()


def test_another_model_or_kv_format_on_the_same_directory_reads_nothing(stories, tiny_llama, tmp_path):
    prompt = prompt_of(stories.tokenizer)
    engine = make_engine(stories, **POOL, kv_cache_dir=str(tmp_path))
    run(engine, prompt)
    engine.close()
    for other in (make_engine(stories, **POOL, kv_cache_dir=str(tmp_path), kv_cache_dtype="int8"),
                  make_engine(stories, **POOL, kv_cache_dir=str(tmp_path), dtype="bfloat16")):
        assert len(other.tiers.tiers[0]) == 0  # its own namespace directory
        assert run(other, prompt)[0].num_cached_tokens == 0
        other.close()
    small = [t % 128 for t in prompt]
    llama = make_engine(tiny_llama, **POOL, kv_cache_dir=str(tmp_path))
    assert run(llama, small)[0].num_cached_tokens == 0
    llama.close()
    assert len(list(tmp_path.iterdir())) == 4  # four namespaces, none sharing a file


def test_a_truncated_tier_file_is_skipped_with_a_warning(stories, cold, tmp_path, caplog):
    prompt = prompt_of(stories.tokenizer)
    engine = make_engine(stories, **POOL, kv_cache_dir=str(tmp_path))
    run(engine, prompt)
    engine.close()
    restarted = make_engine(stories, **POOL, kv_cache_dir=str(tmp_path))
    disk = restarted.tiers.tiers[0]
    kv = restarted.kv
    chain = hash_full_blocks(root_hash(*kv.namespace, None), prompt, kv.block_size)
    path = disk.path(block_name(chain[5], 0))  # the sixth block's file loses its tail
    path.write_bytes(path.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        hit = run(restarted, prompt)
    assert "skipping KV tier file" in caplog.text
    assert hit[0].num_cached_tokens == 5 * 16  # the blocks before it, and none after
    assert_same(hit, cold)
    assert not path.exists()
    restarted.close()


def test_no_block_leaks_across_the_tiers(stories, tmp_path):
    """Pool and tiers stay consistent through evictions, loads and shutdown (check_integrity
    after every step covers the tiers); every evicted block reached both tiers."""
    tok = stories.tokenizer
    engine = make_engine(stories, **POOL, kv_cache_host_bytes=1 << 20, kv_cache_dir=str(tmp_path))
    for p in [prompt_of(tok), *fillers(tok), prompt_of(tok, 150, " He"), prompt_of(tok)]:
        run(engine, p)
    engine.check_integrity()
    tiers = engine.tiers
    host, disk = tiers.tiers
    assert tiers.stats.num_offloaded_blocks == len(host) == len(disk) > 0
    assert set(host.names()) == set(disk.names())
    cached = {b.block_hash for b in engine.kv.pool.blocks if b.block_hash is not None}
    engine.close()
    assert set(disk.names()) >= cached  # the pool's blocks too, at shutdown
    disk.check_integrity()


def test_tier_options_are_checked(stories):
    with pytest.raises(OptionError, match="kv_cache_host_bytes"):
        make_engine(stories, kv_cache_host_bytes=-1)
    with pytest.raises(ValueError, match="prefix caching"):
        make_engine(stories, kv_cache_host_bytes=1 << 20, enable_prefix_caching=False)


def test_a_server_restarted_on_the_same_directory_serves_the_prefix_as_cached(stories, tmp_path):
    import httpx
    from tests.server.conftest import start
    prompt = prompt_of(stories.tokenizer)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    answers = []
    for _ in range(2):  # leaving the first server's block writes its pool down (its lifespan's end)
        with start(stories, "stories260K", **POOL, kv_cache_dir=str(tmp_path)) as server:
            got = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert got.status_code == 200, got.text
            answers.append(got.json())
            metrics = httpx.get(server.url + "/metrics", timeout=30).text
            (tier,) = httpx.get(server.url + "/v1/kv/state", timeout=30).json()["tiers"]
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 192]
    assert 'kvserve_kv_tier_hit_blocks_total{medium="DISK"} 12.0' in metrics  # the restarted server's
    assert tier["medium"] == "DISK" and tier["num_hit_blocks"] == 12 and tier["num_blocks"] >= 12
    assert 0 < tier["num_bytes"] <= tier["max_bytes"] and tier["load_seconds"] > 0
    assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]


@pytest.mark.parametrize("retained", [True, False])
def test_a_retained_system_prompt_survives_in_the_host_tier_while_others_are_evicted(stories, retained):
    """A 16-block pool and a 14-block host tier: the fillers push the system prompt's tail down to
    the host tier, then their own blocks; the tier, ranking by retention as the pool does, drops the
    fillers' blocks and keeps the prompt's (priority 90), so a rerun finds all 12 full blocks. Without
    the retention the tier drops the prompt's blocks first, being the least recently read."""
    tok = stories.tokenizer
    bytes_per_block = make_engine(stories, num_blocks=4, block_size=16).storage.bytes_per_block
    engine = make_engine(stories, num_blocks=16, block_size=16, kv_cache_host_bytes=14 * bytes_per_block)
    prompt = prompt_of(tok)
    retention = [RetentionRange(0, len(prompt), 90)] if retained else []
    run_collecting_logits(engine, [prompt], greedy(8, kv_retention=retention))
    evict(engine, tok)
    host = engine.tiers.tiers[0]
    engine.tiers.check_integrity()
    assert host.eviction_policy == engine.kv.pool.eviction_policy == "lru"
    assert engine.tiers.stats.tiers["CPU"].num_stored_blocks > len(host) == 14  # the tier had to evict
    chain = hash_full_blocks(root_hash(*engine.kv.namespace, None), prompt, engine.kv.block_size)
    num_in_host = sum(block_name(h, 0) in host for h in chain)
    num_in_pool = in_pool(engine, prompt)
    if retained:
        assert num_in_pool > 0 and num_in_host > 0 and num_in_pool + num_in_host == 12
        assert run(engine, prompt)[0].num_cached_tokens == 192
    else:
        assert num_in_pool == num_in_host == 0
        assert run(engine, prompt)[0].num_cached_tokens == 0
    engine.close()


@pytest.mark.parametrize("policy", ["fifo", "priority", "cost"])
def test_every_tier_evicts_by_the_configured_policy(stories, tmp_path, policy):
    engine = make_engine(stories, **POOL, kv_cache_host_bytes=1 << 20, kv_cache_dir=str(tmp_path),
                         eviction_policy=policy)
    assert [t.eviction_policy for t in engine.tiers.tiers] == [policy, policy]
    assert len({id(t.evictor.policy) for t in engine.tiers.tiers} | {id(engine.kv.pool.evictor.policy)}) == 3
    engine.close()
