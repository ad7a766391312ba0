"""Numbers are numbers: a string or a boolean where the API takes a number is a 400 naming the
field, never read as the number it spells (as OpenAI's API does)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "length_penalty"])
@pytest.mark.parametrize("value", ["0.5", True, False, [0.5]])
def test_a_number_field_refuses_strings_and_booleans(stories_server, field, value):
    r = httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": "Once", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field


@pytest.mark.parametrize("value", [0.5, 1, 0])
def test_a_number_field_takes_integers_and_floats(stories_server, value):
    r = httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": "Once", "max_tokens": 2, "top_p": 1, "temperature": value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [{"stream": True, "stream_options": {"include_usage": "yes"}},
                                  {"use_beam_search": True, "n": 2, "early_stopping": 1}])
def test_boolean_fields_refuse_other_types(stories_server, body):
    r = httpx.post(stories_server.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": "Once", "max_tokens": 2, "temperature": 0, **body})
    assert r.status_code == 400, r.text
