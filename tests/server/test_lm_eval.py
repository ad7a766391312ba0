"""EleutherAI's lm-evaluation-harness scores a multiple-choice task through `kvserve serve` (its
`local-completions` model: echo + logprobs over token ids, several prompts a request) and gets
what it gets from the same model run by Hugging Face transformers (its `hf` model): the same
summed log-likelihood for every choice (1e-3) and the same accuracies.

The model is SmolLM2-135M-Instruct, converted by transformers from the GGUF file into a
transformers directory that both sides load; the task is built from Hamlet's verse: which line
comes next, out of four lines of the play."""

import json
import random

import pytest

from tests.eval.test_perplexity import shakespeare
from tests.server.conftest import RunningServer

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval comes with the test extras (bash scripts/setup.sh test)")

TASK = "hamlet_next_line"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, smollm2_path):
    from kvserve.models.convert import gguf_to_hf_directory
    return gguf_to_hf_directory(smollm2_path, str(tmp_path_factory.mktemp("smollm2-hf")))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    lines = [line.strip() for line in shakespeare(chars=60_000).splitlines()]
    verse = [(a, b) for a, b in zip(lines, lines[1:])
             if len(a) > 25 and len(b) > 25 and not a.startswith(("*", "#", "_")) and not b.startswith(("*", "#", "_"))]
    rng = random.Random(0)
    docs = []
    for context, nxt in rng.sample(verse, 24):
        others = rng.sample([b for _, b in verse if b != nxt], 3)
        gold = rng.randrange(4)
        docs.append({"context": context, "choices": others[:gold] + [nxt] + others[gold:], "gold": gold})
    d = tmp_path_factory.mktemp("task")
    with open(d / "docs.jsonl", "w") as f:
        f.write("\n".join(json.dumps(doc) for doc in docs) + "\n")
    (d / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return str(d)


def evaluate(model, model_args, task_dir):
    from lm_eval.tasks import TaskManager
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                                  task_manager=TaskManager(include_path=task_dir), batch_size=8, random_seed=0)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return out["results"][TASK], [[r[0] for r in s["resps"]] for s in samples]


def test_lm_eval_through_the_server_equals_transformers(hf_dir, task_dir, monkeypatch):
    from kvserve.models.registry import load_weights
    from kvserve.server.app import create_app
    from tests.conftest import make_engine
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    engine = make_engine(load_weights(hf_dir), num_blocks=256, max_model_len=512)
    with RunningServer(create_app(engine, "smollm2"), engine) as server:
        ours, our_lls = evaluate("local-completions", {
            "model": "smollm2", "base_url": server.url + "/v1/completions", "tokenizer": hf_dir,
            "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1}, task_dir)
    theirs, their_lls = evaluate("hf", {"pretrained": hf_dir, "dtype": "float32", "device": "cpu"}, task_dir)
    assert len(our_lls) == 24 and all(len(r) == 4 for r in our_lls)
    gap = max(abs(a[0] - b[0]) for mine, ref in zip(our_lls, their_lls) for a, b in zip(mine, ref))
    print(f"lm-eval {TASK}: acc {ours['acc,none']:.4f} (transformers {theirs['acc,none']:.4f}), "
          f"acc_norm {ours['acc_norm,none']:.4f}; largest log-likelihood gap {gap:.2e}")
    for mine, ref in zip(our_lls, their_lls):
        for (ll, greedy), (ref_ll, ref_greedy) in zip(mine, ref):
            assert ll == pytest.approx(ref_ll, abs=1e-3) and greedy == ref_greedy
    assert ours["acc,none"] == theirs["acc,none"] and ours["acc_norm,none"] == theirs["acc_norm,none"]
    assert 0.25 < ours["acc,none"]  # better than chance: the scores are the model's, not noise
