"""The documentation site in a real browser: `mkdocs build --strict` writes the site, Python's
http.server serves it on 127.0.0.1, and Debian's headless Chromium (driven by Selenium, as the
`asyncrl view` suite does) opens the quick start and the configuration reference: each page has
its title, its navigation and its search, the theme's scripts ran, and the browser's console has no
error (the site loads nothing from outside itself: no web fonts). A screenshot of each lands in $ASYNCRL_SCREENSHOTS (default runs/view_screenshots).

Marker `browser`: `python -m pytest -q -m browser tests/integration`.
"""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
except ImportError:  # pragma: no cover - the test extra brings it
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise
    pytest.skip("selenium is in the test extra: pip install -e '.[test]'",
                allow_module_level=True)

ROOT = Path(__file__).parent.parent.parent
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]
if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        raise RuntimeError(f"{CHROMIUM} / {DRIVER} missing: .ci/run installs Debian's chromium "
                           "and chromium-driver")
    pytest.skip("needs Debian's chromium and chromium-driver: apt-get install chromium "
                "chromium-driver", allow_module_level=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site served over HTTP on 127.0.0.1: its base URL."""
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                           cwd=ROOT, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--disable-gpu"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.mark.parametrize(("path", "title", "text"), [
    ("tutorials/quickstart/", "Quick start", "asyncrl train configs/train_tiny.yaml"),
    ("reference/configuration/", "Configuration", "max_head_offpolicyness"),
])
def test_a_page_of_the_built_site_opens_in_chromium(site, browser, path, title, text):
    browser.get(f"{site}/{path}")
    assert title in browser.title
    body = browser.find_element(By.TAG_NAME, "article").text
    assert text in body
    # the Material theme's scripts ran: its navigation and search are in the page
    assert browser.find_elements(By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link")
    assert browser.find_elements(By.CSS_SELECTOR, "input.md-search__input")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    shots = Path(os.environ.get("ASYNCRL_SCREENSHOTS", ROOT / "runs" / "view_screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(shots / f"docs_{path.strip('/').replace('/', '_')}.png"))
