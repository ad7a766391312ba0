"""Beam search in the engine returns exactly what Hugging Face generate(num_beams=k,
do_sample=False) returns: the same sequences in the same order, scores within 1e-4 (fp32), on
SmolLM2 (HF loads the same GGUF) and a random-weight Llama, k = 2 and 4, with and without EOS
reached, length_penalty != 1, each early_stopping mode; its beams share blocks, keep the
scheduler's invariants every step and leak nothing."""

import os

import pytest
import torch

from kvserve import SamplingParams
from tests.conftest import make_engine

transformers = pytest.importorskip("transformers")


def beam_params(k, max_tokens, **kw):
    return SamplingParams(use_beam_search=True, beam_width=k, n=k, temperature=0, max_tokens=max_tokens, **kw)


def run_beams(engine, prompt, params):
    engine.add_request("beams", prompt, params)
    out, peak = None, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out = o
        engine.scheduler.check_integrity()
        peak = max(peak, engine.kv.pool.num_used_blocks)
    assert engine.kv.pool.num_used_blocks == 0 and not engine.scheduler.requests
    return out, peak


def hf_beams(hf, prompt, params, eos):
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), num_beams=params.beam_width, num_return_sequences=params.n,
                        do_sample=False, max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
                        early_stopping=params.early_stopping, eos_token_id=list(eos) or None, pad_token_id=0,
                        output_scores=True, return_dict_in_generate=True)
    seqs = []
    for seq in g.sequences.tolist():
        gen = seq[len(prompt):]
        cut = next((i for i, t in enumerate(gen) if t in eos), None)
        seqs.append(gen if cut is None else gen[:cut + 1])
    return seqs, g.sequences_scores.tolist()


def assert_like_hf(out, hf_seqs, hf_scores):
    assert [c.token_ids for c in out.outputs] == hf_seqs
    assert max(abs(c.score - s) for c, s in zip(out.outputs, hf_scores)) < 1e-4


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32).eval()


CASES = [dict(k=2, max_tokens=12), dict(k=4, max_tokens=12, length_penalty=0.5, early_stopping=True),
         dict(k=4, max_tokens=10, length_penalty=2.0, early_stopping="never")]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_smollm2_beams_equal_transformers(smollm2, hf_smollm2, case):
    case = dict(case)
    k, max_tokens = case.pop("k"), case.pop("max_tokens")
    params = beam_params(k, max_tokens, **case)
    tok = smollm2.tokenizer
    for prompt in (tok.encode("The capital of France is"),
                   tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])):
        out, _ = run_beams(make_engine(smollm2, max_model_len=256, exact=True), prompt, params)
        assert_like_hf(out, *hf_beams(hf_smollm2, prompt, params, tok.eos_token_ids))
    assert any(c.finish_reason == "stop" and c.token_ids[-1] in tok.eos_token_ids for c in out.outputs)  # EOS reached


@pytest.fixture(scope="module")
def random_llama_pair(tmp_path_factory):
    """A random-weight Llama saved as a Hugging Face directory, loaded by both."""
    from kvserve.models.registry import load_weights
    path = tmp_path_factory.mktemp("beam-llama")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_weights(str(path))


@pytest.mark.parametrize("k, eos", [(2, ()), (4, ()), (4, "frequent")], ids=["k2", "k4", "k4-eos"])
def test_random_llama_beams_equal_transformers(random_llama_pair, k, eos):
    hf, loaded = random_llama_pair
    from kvserve.core.request import Request
    prompt = [5, 17, 3, 44, 9, 61, 2, 30]
    params = beam_params(k, 14, length_penalty=1.5, ignore_eos=not eos)
    if eos:  # make a token the beams often pick an end, and favour short hypotheses: some finish early
        plain, _ = run_beams(make_engine(loaded, block_size=4), prompt, beam_params(k, 14, ignore_eos=True))
        eos = (max(set(t for c in plain.outputs for t in c.token_ids[2:]), key=lambda t: sum(
            c.token_ids.count(t) for c in plain.outputs)),)
        params = beam_params(k, 14, length_penalty=0.3)
    engine = make_engine(loaded, block_size=4)
    # the random model has no tokenizer, so no EOS of its own: the request carries the chosen one
    req = Request("beams", prompt, params, eos_token_ids=tuple(eos))
    engine.scheduler.add_request(req)
    engine.outputs.add(req, None)
    engine.beams.add(req, params.max_tokens)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out = o
        engine.scheduler.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0
    assert_like_hf(out, *hf_beams(hf, prompt, params, eos))
    if eos:
        assert any(c.finish_reason == "stop" for c in out.outputs) and any(
            len(c.token_ids) < 14 for c in out.outputs)


def test_beams_share_blocks(stories):
    prompt = stories.tokenizer.encode("Once upon a time, there was a little girl named Lily who")
    out, peak = run_beams(make_engine(stories, block_size=4), prompt, beam_params(4, 24, ignore_eos=True))
    per_sequence = -(-(len(prompt) + 24) // 4)
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 24 for c in out.outputs)
    assert peak < 4 * per_sequence  # the prompt's blocks are held once, not four times
    assert out.outputs[0].score >= out.outputs[-1].score


def test_beam_search_refuses_what_it_cannot_do():
    for bad, field in [(dict(temperature=0.8), "temperature"), (dict(n=5, beam_width=4), "n"),
                       (dict(stop=["."]), "use_beam_search"), (dict(repetition_penalty=1.2), "use_beam_search"),
                       (dict(early_stopping="sometimes"), "early_stopping")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(use_beam_search=True, **{"temperature": 0, **bad})
