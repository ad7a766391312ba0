"""`kvserve visualize` in a real browser: stepping forward, back and by the slider shows, at
every step, the cache lengths and block tables the engine's trace recorded."""

import json

import pytest

from kvserve.server.visualize import visualize
from tests.browser.conftest import console_errors


@pytest.fixture(scope="module")
def page(tmp_path_factory, stories_path):
    d = tmp_path_factory.mktemp("viz")
    out, trace = d / "kv.html", d / "kv.trace"
    shown = visualize(str(out), stories_path, save_trace=str(trace))
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return out, shown, [r for r in records if r["kind"] == "step"]


def test_the_scenario_shows_every_mechanism(page):
    _, shown, steps = page
    assert shown["copy_on_write"] >= 1 and shown["preemptions"] >= 1 and shown["evictions"] >= 1
    assert shown["prefix_hit_rate"] > 0
    assert any(q["phase"] == "prefill" and q["num_tokens"] > 8 for s in steps for q in s["scheduled"])
    decode = [q for s in steps for q in s["scheduled"] if q["phase"] == "decode"]
    assert decode and all(q["num_tokens"] == 1 for q in decode)


def shown_state(browser):
    return browser.execute_script("""
        const lens = {}, tables = {};
        document.querySelectorAll('#reqs .len').forEach(e => lens[e.dataset.req] = +e.textContent);
        document.querySelectorAll('#reqs td.table').forEach(e =>
            tables[e.dataset.req] = [...e.querySelectorAll('.tb')].map(x => +x.textContent));
        return {index: window.kvViz.index, step: +document.getElementById('step').dataset.step, lens, tables,
                cells: document.querySelectorAll('#grid .cell').length};""")


def expected(steps, index):
    s = steps[index]
    st = s["state"]
    return {"step": s["step"], "lens": {r["id"]: r["computed_tokens"] for r in st["requests"]},
            "tables": {r["id"]: [b for t in r["tables"] for b in t] for r in st["requests"]},
            "cells": st["totals"]["num_blocks"]}


def test_stepping_shows_what_the_trace_says(browser, page, tmp_path):
    from selenium.webdriver.common.by import By
    out, _, steps = page
    browser.get(out.as_uri())
    browser.get_log("browser")  # what earlier pages logged is theirs
    fwd, back = browser.find_element(By.ID, "fwd"), browser.find_element(By.ID, "back")
    moves = [("fwd", 1)] * 12 + [("back", 1)] * 5 + [("slider", len(steps) - 1), ("fwd", 1), ("slider", 0),
                                                      ("back", 1)] + [("fwd", 1)] * 30 + [("back", 1)] * 3
    index, changed = 0, 0
    for kind, arg in moves:
        before = shown_state(browser)
        if kind == "fwd":
            fwd.click()
            index = min(index + 1, len(steps) - 1)
        elif kind == "back":
            back.click()
            index = max(index - 1, 0)
        else:
            browser.execute_script("const s = document.getElementById('slider'); s.value = arguments[0];"
                                   "s.dispatchEvent(new Event('input'));", arg)
            index = arg
        now = shown_state(browser)
        assert now["index"] == index
        assert {k: now[k] for k in ("step", "lens", "tables", "cells")} == expected(steps, index)
        changed += now["lens"] != before["lens"]
    assert changed > 20  # the lengths really moved with the steps
    # a decode step adds exactly one row to the request it decodes
    for i in range(1, len(steps)):
        for q in steps[i]["scheduled"]:
            before, after = expected(steps, i - 1)["lens"], expected(steps, i)["lens"]
            if q["phase"] == "decode" and q["id"] in before and q["id"] in after:  # not finished by it
                assert after[q["id"]] == before[q["id"]] + 1
    assert console_errors(browser) == []
    browser.save_screenshot(str(tmp_path / "visualize.png"))
