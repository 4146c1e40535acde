"""Debian's headless Chromium driven by Selenium, for the browser suite (marker `browser`):
`.ci/run` installs chromium and chromium-driver; nothing is downloaded at run time. Importing this
module skips the importing test module where they (or selenium) are missing, except under CI,
where a missing part fails the run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
except ImportError:  # pragma: no cover - the test extra brings it
    if IN_CI:
        raise
    pytest.skip("selenium is in the test extra: pip install -e '.[test]'",
                allow_module_level=True)

if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
    if IN_CI:
        raise RuntimeError(f"{CHROMIUM} / {DRIVER} missing: .ci/run installs Debian's chromium "
                           "and chromium-driver")
    pytest.skip("needs Debian's chromium and chromium-driver: apt-get install chromium "
                "chromium-driver", allow_module_level=True)


def chromium(window: str = "1500,1100", console_log: bool = False) -> Iterator:
    """A headless Chromium driver (quit on exit); `console_log`: keep the page's console."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                f"--window-size={window}", "--disable-gpu"):
        options.add_argument(arg)
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot_dir() -> Path:
    """$ASYNCRL_SCREENSHOTS (default runs/view_screenshots), created."""
    out = Path(os.environ.get("ASYNCRL_SCREENSHOTS", ROOT / "runs" / "view_screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    return out
