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
import subprocess
import sys
import threading

import pytest
from headless_chromium import ROOT, chromium, screenshot_dir  # (skips if absent)
from selenium.webdriver.common.by import By

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]


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
    yield from chromium("1400,1000", console_log=True)


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
    browser.save_screenshot(str(screenshot_dir() / f"docs_{path.strip('/').replace('/', '_')}.png"))
