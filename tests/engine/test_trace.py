"""The step trace (`--trace FILE`, what `kvserve visualize` draws) is what the engine did: every
recorded state passes the cache's invariants, the tokens written step by step are the request's
tokens at their positions, and the CLI records and draws traces, refusing what is not one."""

import json

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.trace import StepTrace, load_trace
from tests.conftest import make_engine
from tests.server.test_kv_state import check


def test_trace_states_hold_the_invariants_and_the_tokens(stories):
    engine = make_engine(stories, block_size=8, num_blocks=24, max_num_seqs=3)
    engine.trace = trace = StepTrace(engine)
    prompts = ["Once upon a time, there was a little girl named Lily.", "Once upon a time, there was a dog.",
               "Tom had a big red ball and he liked to play with it every day in the garden."]
    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=30 + 10 * i, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    header, steps = trace.records[0], trace.records[1:]
    assert header["kind"] == "header" and header["num_blocks"] == 24 and header["block_size"] == 8
    assert [s["step"] for s in steps] == list(range(1, engine.num_steps + 1))
    written: dict[str, list] = {}
    for s in steps:
        check(s["state"])
        for q in s["scheduled"]:
            row = written.setdefault(q["id"], [])
            if "cached_pieces" in q:  # read from the prefix cache, not written
                assert len(row) < q["start"] and len(q["cached_pieces"]) == q["start"]
                row[:] = q["cached_pieces"]
            del row[q["start"]:]  # a recomputed request writes its positions again
            assert len(row) == q["start"] and q["context_len"] == q["start"] + q["num_tokens"]
            row.extend(q["pieces"])
    for rid, o in outs.items():
        ids = o.prompt_token_ids + o.outputs[0].token_ids
        assert written[rid] == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids[:-1]]
    assert steps[-1]["state"]["totals"]["used"] == 0 and steps[-1]["state"]["requests"] == []
    assert any("cached_pieces" in q for s in steps for q in s["scheduled"])


def test_cli_records_and_draws_a_trace(stories_path, tmp_path, capsys):
    from kvserve.cli import main
    trace, page = tmp_path / "run.trace", tmp_path / "run.html"
    assert main(["generate", "Once upon a time", "--model", stories_path, "--max-tokens", "12",
                 "--trace", str(trace)]) == 0
    records = load_trace(str(trace))
    assert records[0]["kind"] == "header" and len(records) == 1 + 12  # one prefill step, 11 decodes, 1 finishing
    assert main(["visualize", "--trace", str(trace), "--out", str(page)]) == 0
    html = page.read_text()
    assert "kvserve · the KV cache, step by step" in html and '"kind": "header"' in html
    assert "/*__TRACE__*/" not in html and "</script>" not in html.split("const TRACE =")[1].split("\n")[0]
    assert "12 steps" in capsys.readouterr().out
    bad = tmp_path / "bad.trace"
    bad.write_text(json.dumps({"kind": "step"}) + "\n")
    assert main(["visualize", "--trace", str(bad), "--out", str(page)]) == 2
    assert "not a kvserve trace" in capsys.readouterr().err
    assert main(["visualize", "--trace", str(tmp_path / "missing"), "--out", str(page)]) == 2
    assert main(["visualize", "--trace", str(trace), "--model", stories_path]) == 2
