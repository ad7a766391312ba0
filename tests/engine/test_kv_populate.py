"""--kv-cache-populate: the engine writes every page of its CPU cache while it starts (as vLLM
and llama.cpp do), where by default pages arrive on first write; either way it decodes the same."""

import os

import torch

from kvserve.engine.args import engine_config, engine_options
from tests.conftest import greedy, make_engine, run_collecting_logits
from tests.engine.test_options import engine_parser
from tests.kv.test_storage import all_pages, resident_kib

TEXT = "Once upon a time there was a little girl who lived in a house by the sea. " * 2


def test_the_flag_sets_the_option():
    assert engine_config(**engine_options(engine_parser().parse_args(["--kv-cache-populate"]))).cache.populate
    assert not engine_config(**engine_options(engine_parser().parse_args([]))).cache.populate


def test_a_populated_cache_is_resident_at_start_and_decodes_as_the_lazy_one(stories):
    lazy = make_engine(stories, max_model_len=64, num_blocks=512)
    sizes = [t.numel() * t.element_size() >> 10 for t in all_pages(lazy.runner.storage)]
    assert sum(sizes) >= 512  # enough pages that "resident" means something
    # (asked before the next engine's writes: its mappings may sit next to these, in one huge page)
    assert sum(resident_kib(t) for t in all_pages(lazy.runner.storage)) < sum(sizes) // 2
    full = make_engine(stories, max_model_len=64, num_blocks=512, kv_cache_populate=True)
    page_kib = os.sysconf("SC_PAGE_SIZE") >> 10
    for t, kib in zip(all_pages(full.runner.storage), sizes):
        assert resident_kib(t) >= kib - page_kib and not t.any()
    ids = stories.tokenizer.encode(TEXT)
    prompts = [ids[:n] for n in (5, 17, 40)]
    (ref, ref_logits), (got, logits) = (run_collecting_logits(e, prompts, greedy(12, ignore_eos=True))
                                        for e in (lazy, full))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    for a, b in zip(ref_logits.values(), logits.values()):
        assert torch.equal(torch.stack(a), torch.stack(b))
