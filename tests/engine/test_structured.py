"""Structured outputs on SmolLM2: whatever is drawn (greedy or sampled), a request constrained by
a JSON schema ends with JSON that validates against it, by a regex with a full match, by a choice
with one of the strings, by a grammar with a sentence of it; random schemas (Hypothesis) too.
Constrained and unconstrained requests share batches; the others are unchanged."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.core.sampling_params import SamplingParams
from tests.conftest import make_engine

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(smollm2):
    return make_engine(smollm2, max_model_len=1024, max_num_seqs=16, exact=True)


def run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]), params)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0]
        engine.check_integrity()
    return outs


def test_every_kind_of_constraint_holds_greedy_and_sampled(engine):
    requests, checks = [], {}
    for temp in (0.0, 1.0):
        for k in range(1):
            tag = f"{temp}-{k}"
            p = dict(temperature=temp, seed=k, max_tokens=80)
            requests += [
                (f"json{tag}", "Describe a person as JSON.", SamplingParams(structured=("json_schema", json.dumps(PERSON)), **p)),
                (f"regex{tag}", "Give a phone number.", SamplingParams(structured=("regex", r"\(\d{3}\) \d{3}-\d{4}"), **p)),
                (f"choice{tag}", "Is the sky blue?", SamplingParams(structured=("choice", '["yes", "no", "maybe"]'), **p)),
                (f"grammar{tag}", "Add two numbers.", SamplingParams(
                    structured=("grammar", 'start: NUM " + " NUM " = " NUM\nNUM: /[0-9]{1,3}/'), **p)),
            ]
            checks.update({f"json{tag}": lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
                           f"regex{tag}": lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t) is not None,
                           f"choice{tag}": lambda t: t in ("yes", "no", "maybe"),
                           f"grammar{tag}": lambda t: re.fullmatch(r"\d{1,3} \+ \d{1,3} = \d{1,3}", t) is not None})
    free = SamplingParams(temperature=0, max_tokens=20)
    alone = run(engine, [("free", "What is the capital of France?", free)])["free"].text
    outs = run(engine, requests + [("free", "What is the capital of France?", free)])
    for rid, check in checks.items():
        assert outs[rid].finish_reason == "stop", (rid, outs[rid].text)
        assert check(outs[rid].text), (rid, outs[rid].text)
    assert outs["free"].text == alone  # an unconstrained request beside them is untouched


def schemas(depth: int = 2):
    """Small JSON schemas: typed leaves (bounded strings and numbers, enums) in objects and arrays."""
    leaf = st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-100, 100), st.integers(0, 1000)),
        st.just({"type": "boolean"}),
        st.builds(lambda xs: {"enum": xs}, st.lists(st.sampled_from(["red", "green", "blue", 1, 2, None]),
                                                   min_size=1, max_size=4, unique=True)),
    )

    def nested(children):
        obj = st.dictionaries(st.sampled_from(["a", "b", "name", "id", "tags"]), children, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props),
                           "additionalProperties": False})
        arr = st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3))
        return st.one_of(obj, arr)
    return st.recursive(leaf, nested, max_leaves=6)


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(batch=st.lists(schemas(), min_size=5, max_size=5))
def test_random_schemas_always_give_valid_json(engine, batch):
    outs = run(engine, [(f"s{i}", "Answer with JSON.", SamplingParams(
        temperature=1.0, seed=i, max_tokens=200, structured=("json_schema", json.dumps(schema))))
        for i, schema in enumerate(batch)])
    for i, schema in enumerate(batch):
        out = outs[f"s{i}"]
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_bad_constraints_are_refused_by_name(engine):
    for spec, needle in ((("json_schema", "{not json"), "json_schema"), (("regex", "("), "regex"),
                         (("choice", "[]"), "choice"), (("grammar", "start: ("), "grammar")):
        with pytest.raises(ValueError, match=needle):
            engine.add_request(None, "hi", SamplingParams(structured=spec))
    with pytest.raises(ValueError, match="structured"):
        SamplingParams(structured=("json_schema", "{}"), n=2)


@pytest.mark.parametrize("spec", [("grammar", "start: x\nx: x"), ("regex", "[^\\x00-\\U0010ffff]")])
def test_a_grammar_that_matches_nothing_is_refused_at_once(engine, spec):
    """It compiles, but no output can satisfy it: refused when added (a 400 from the server),
    not answered with an empty completion."""
    with pytest.raises(ValueError, match=f"structured {spec[0]}: the grammar matches nothing"):
        engine.add_request(None, "hi", SamplingParams(structured=spec))
    assert not engine.has_unfinished()
