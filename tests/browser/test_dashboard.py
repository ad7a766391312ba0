"""/dashboard in a real browser while requests run: one cell per block, a chosen request's lit
cells are its block table (in order), no console errors, every cell free or cached at the end."""

import threading
import time

import httpx

from tests.browser.conftest import console_errors
from tests.server.conftest import API_KEY, start

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def wait_for(predicate, timeout=30.0, every=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out waiting")


def test_dashboard_draws_the_engine_state(browser, stories, tmp_path):
    from selenium.webdriver.common.by import By
    with start(stories, "stories260K", API_KEY, num_blocks=96, max_num_seqs=8) as server:
        browser.get(server.url + "/dashboard")
        browser.get_log("browser")  # what earlier pages logged is theirs
        assert "API key" in wait_for(lambda: browser.find_element(By.ID, "conn").text)  # 401 without the key
        browser.find_element(By.ID, "key").send_keys(API_KEY)
        browser.find_element(By.ID, "connect").click()
        wait_for(lambda: browser.find_element(By.ID, "conn").text.startswith("live"))
        assert API_KEY not in browser.current_url and API_KEY not in browser.page_source

        prefix = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
        threads = [threading.Thread(target=lambda i=i: httpx.post(server.url + "/v1/completions", headers=AUTH,
                   timeout=120, json={"prompt": prefix + f"Day {i}", "max_tokens": 220 + 20 * i, "temperature": 0,
                                      "ignore_eos": True})) for i in range(4)]
        for th in threads:
            th.start()
        drawn = wait_for(lambda: browser.execute_script(
            "const s = window.kvDashboard.state; return s && s.requests.filter(r => r.status === 'running').length >= 2"
            " && s.requests.every(r => r.computed_tokens > 30) ? s : null"))
        cells = browser.find_elements(By.CSS_SELECTOR, "#grid .cell")
        assert len(cells) == drawn["totals"]["num_blocks"] == 96

        # choose a request: its lit cells, by their numbers, are its table in the state the page drew
        row = browser.find_element(By.CSS_SELECTOR, "#reqs tr.req")
        rid = row.get_attribute("data-id")
        row.click()
        shown = browser.execute_script("""
            const s = window.kvDashboard.state, r = s.requests.find(q => q.id === arguments[0]);
            const lit = [...document.querySelectorAll('#grid .cell.lit')]
              .map(c => [+c.dataset.order, +c.dataset.id]).sort((a, b) => a[0] - b[0]).map(x => x[1]);
            return {step: s.step, table: r ? r.tables[0] : null, lit: lit};""", rid)
        assert shown["table"] and shown["lit"] == shown["table"]
        # ... and that table is the engine's: the server's state now extends it (tables only grow)
        now = httpx.get(server.url + "/v1/kv/state", headers=AUTH, timeout=30).json()
        live = next((r for r in now["requests"] if r["id"] == rid), None)
        if live is not None:
            assert live["tables"][0][:len(shown["table"])] == shown["table"]
        shared = browser.execute_script("return document.getElementById('sharing').textContent")
        assert "shared by" in shared  # the common prompt's blocks
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000

        for th in threads:
            th.join()
        server.wait_idle()
        wait_for(lambda: browser.execute_script(
            "const s = window.kvDashboard.state; return s && s.requests.length === 0 && s.totals.used === 0"))
        classes = browser.execute_script(
            "return [...document.querySelectorAll('#grid .cell')].map(c => c.className)")
        assert len(classes) == 96 and all(c in ("cell free", "cell cached") for c in classes)
        assert any(c == "cell cached" for c in classes)
        # it keeps polling an idle engine (however quickly the requests above finished)
        updates = browser.execute_script("return window.kvDashboard.polls")
        wait_for(lambda: browser.execute_script("return window.kvDashboard.polls") >= updates + 2)
        assert console_errors(browser) == []
        browser.save_screenshot(str(tmp_path / "dashboard-idle.png"))
        browser.get("about:blank")  # the page stops polling before its server goes
