"""KV events from the engine: every block the pool registers is a BlockStored naming its hash,
parent and tokens, every hash dropped a BlockRemoved, a reset AllBlocksCleared; over ZMQ they
arrive as vLLM's KVEventBatch (msgpack, tagged arrays) in the multipart (topic, seq, payload)."""

import msgpack
import pytest
import zmq

from kvserve.core.block_hash import hash_full_blocks, root_hash
from kvserve.core.kv_cache_manager import block_name
from kvserve.distributed.workers import free_port
from tests.conftest import greedy, make_engine, run_collecting_logits
from tests.engine.test_offload import prompt_of


def test_the_log_names_each_block_its_parent_and_tokens(stories):
    engine = make_engine(stories, num_blocks=24, block_size=16)
    prompt = prompt_of(stories.tokenizer, 60, "")
    run_collecting_logits(engine, [prompt], greedy(4))
    events, missed = engine.kv_events.since(0)
    assert not missed and [e.seq for e in events] == list(range(len(events)))
    stored = [e for e in events if e.kind == "BlockStored"]
    root = root_hash(*engine.kv.namespace, None)
    chain = hash_full_blocks(root, prompt, 16)
    assert [e.block_hashes[0] for e in stored[:len(chain)]] == [block_name(h, 0) for h in chain]
    assert stored[0].parent_block_hash == block_name(root, 0) and stored[0].token_ids == tuple(prompt[:16])
    assert all(e.medium == "GPU" and e.block_size == 16 for e in stored)
    engine.kv.reset_prefix_cache()
    after, _ = engine.kv_events.since(len(events))
    assert after[-1].kind == "AllBlocksCleared" and {e.kind for e in after[:-1]} == {"BlockRemoved"}
    assert {e.block_hashes[0] for e in after if e.kind == "BlockRemoved"} == {e.block_hashes[0] for e in stored}


def test_events_arrive_over_zmq_in_vllms_format(stories):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = make_engine(stories, num_blocks=24, block_size=16, kv_events=endpoint)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        engine.kv_events.publish()  # nothing yet: nothing sent
        prompt = prompt_of(stories.tokenizer, 60, "")
        received = []
        for _ in range(50):  # a subscriber joins a moment after connecting: send until it hears
            run_collecting_logits(engine, [prompt], greedy(1))
            engine.kv.reset_prefix_cache()
            engine.kv_events.publish()
            if sub.poll(100):
                received.append(sub.recv_multipart())
                break
        assert received, "no event batch arrived"
        topic, seq, payload = received[0]
        assert topic == b"" and len(seq) == 8
        ts, events = msgpack.unpackb(payload)
        assert isinstance(ts, float) and events
        kinds = {e[0] for e in events}
        assert kinds <= {"BlockStored", "BlockRemoved", "AllBlocksCleared"} and "BlockStored" in kinds
        stored = next(e for e in events if e[0] == "BlockStored")
        _, hashes, parent, token_ids, block_size, lora_id, medium = stored
        assert len(hashes) == 1 and isinstance(hashes[0], bytes) and isinstance(parent, bytes)
        assert token_ids == prompt[:16] and block_size == 16 and lora_id is None and medium == "GPU"
    finally:
        sub.close(linger=0)
        ctx.term()
        engine.close()


def test_a_bad_events_address_is_refused_by_name(stories):
    with pytest.raises(ValueError, match="--kv-events cannot bind"):
        make_engine(stories, kv_events="nonsense://x")
