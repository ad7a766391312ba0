"""Headless Chromium driven by Selenium: Debian's `chromium` and `chromium-driver` (scripts/setup.sh
test installs them where it can). Without them the browser tests skip, saying why."""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterator

import pytest


def _find(*names: str) -> str | None:
    for n in names:
        path = shutil.which(n)
        if path:
            return path
    return None


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium comes with the test extras")
    binary = os.environ.get("KVSERVE_CHROMIUM") or _find("chromium", "chromium-browser", "google-chrome")
    driver_path = os.environ.get("KVSERVE_CHROMEDRIVER") or _find("chromedriver", "chromium-driver")
    if binary is None or driver_path is None:
        pytest.skip("no Chromium here: apt-get install chromium chromium-driver (bash scripts/setup.sh test does)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1500,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    from selenium.webdriver.chrome.service import Service
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: Any) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
