"""RoPE positions equal the cache length: the token fed at decode step t sits at prompt_len + t."""

import torch

from tests.conftest import greedy, make_engine


def record_positions(engine):
    seen = []
    forward = engine.model.forward

    def spy(input_ids, positions, ctx):
        seen.append(positions.tolist())
        return forward(input_ids, positions, ctx)

    engine.model.forward = spy
    return seen


def test_decode_step_t_is_at_prompt_len_plus_t(stories):
    engine = make_engine(stories)
    seen = record_positions(engine)
    prompt = stories.tokenizer.encode("Once upon a time there was")
    engine.add_request("r", prompt, greedy(6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert seen[0] == list(range(len(prompt)))
    assert [s for s in seen[1:]] == [[len(prompt) + t] for t in range(5)]


def test_a_wrong_offset_changes_the_logits(stories):
    """The position test above matters: feeding a decode token one position off changes the
    next-token logits, so an off-by-one in the runner could not go unnoticed."""
    from kvserve.attention.backend import AttentionMetadata, PrefillSpan
    from kvserve.attention.layer import ForwardContext
    engine = make_engine(stories)
    model = engine.model
    ids = stories.tokenizer.encode("Once upon a time there was a girl")
    T = len(ids)

    def last_logits(positions):
        meta = engine.runner.backend.build_metadata(AttentionMetadata(prefills=[PrefillSpan(0, T, T)]), None)
        hidden = model(torch.tensor(ids), torch.tensor(positions), ForwardContext(None, [meta]))
        return model.compute_logits(hidden[-1:])

    right = last_logits(list(range(T)))
    wrong = last_logits(list(range(T - 1)) + [T])
    assert (right - wrong).abs().max().item() > 1e-3
