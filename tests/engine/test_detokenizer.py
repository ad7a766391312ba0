"""Incremental detokenization gives, at every step, exactly the text of decoding the whole
output, for both tokenizer kinds: byte-level BPE (SmolLM2, whose multi-byte characters span
tokens) and llama2.c's sentencepiece pieces (stories260K); and after a rollback too."""

import random

import pytest

from kvserve.engine.output_processor import IncrementalDetokenizer

TEXT = ("Once upon a time, the café served crème brûlée — 日本語のテキスト 🙂🚀 and ümlauts; "
        "tokens\tacross\nlines, numbers 12345 and emoji 👩‍👩‍👧 done.")


def streams(tokenizer, seed):
    """Real text's ids, and random ids (any byte token, special tokens included)."""
    rng = random.Random(seed)
    real = tokenizer.encode(TEXT, add_special_tokens=False)
    noise = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    return [real, noise, real[:40] + noise[:40] + real[40:]]


@pytest.mark.parametrize("model", ["smollm2", "stories"])
def test_every_step_equals_a_full_decode(model, request):
    tokenizer = request.getfixturevalue(model).tokenizer
    for seed, ids in enumerate(streams(tokenizer, 0)):
        rng = random.Random(seed)
        d, i = IncrementalDetokenizer(tokenizer), 0
        while i < len(ids):
            i += rng.randint(1, 3)  # one token a step, or several (accepted proposals)
            assert d.text(ids[:i]) == tokenizer.decode(ids[:i]), (model, seed, i)


def test_a_rollback_is_read_again(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    for i in range(1, 30):
        d.text(ids[:i])
    other = ids[:20] + tok.encode(" and then something else", add_special_tokens=False)
    assert d.text(other, num_truncations=1) == tok.decode(other)
