"""Screenshots of `asyncrl view` over a run directory, for the README.

Starts `asyncrl view RUN --port 0`, drives Debian's headless Chromium (chromium and
chromium-driver from the OS packages) and saves, under OUT:

- view_curves.png: the curves tab;
- view_tokens_version.png: the recorded step where weight updates reached the most generations
  (its group they reached most),
  tokens coloured by the policy version that sampled them;
- view_tokens_mismatch.png: the same step coloured by |trainer - sampler| logprob;
- view_events.png: the events tab.

    python benchmarks/view_screenshots.py runs/main_job --out benchmarks/results --docs docs/assets

--docs DIR also copies the two the documentation shows (curves, token versions) into DIR.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait


def busiest_step(run: Path) -> tuple[int, int]:
    """The recorded step whose samples a weight update reached most often, and its group that
    a weight update reached most often (the step's first group when none was)."""
    best, most = None, -1
    for path in sorted((run / "samples").glob("step_*.jsonl")):
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        by_group: dict[int, int] = {}
        for r in rows:
            by_group[r["group"]] = by_group.get(r["group"], 0) + len(r.get("weight_updates", []))
        n = sum(by_group.values())
        if n > most:
            group = max(by_group, key=lambda g: (by_group[g], -g)) if by_group else 0
            best, most = (int(path.stem.split("_")[1]), group), n
    if best is None:
        raise SystemExit(f"{run} has no samples/: run it with the current asyncrl")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--width", type=int, default=1500)
    ap.add_argument("--height", type=int, default=1100)
    ap.add_argument("--docs", type=Path, help="also copy the pictures the docs show here")
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "view", str(ns.run),
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    url = proc.stdout.readline().split(": ", 1)[1].strip()
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={ns.width},{ns.height}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    wait = WebDriverWait(driver, 60, poll_frequency=0.2)
    try:
        driver.get(url)
        wait.until(lambda d: d.find_element(By.ID, "charts").get_attribute("data-drawn"))
        time.sleep(1)  # plotly's transitions
        driver.save_screenshot(str(ns.out / "view_curves.png"))
        step, group = busiest_step(ns.run)
        driver.get(f"{url}?tab=samples&step={step}")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".sample .tok"))
        Select(driver.find_element(By.ID, "group")).select_by_value(str(group))
        wait.until(lambda d: {e.get_attribute("data-group") for e in
                              d.find_elements(By.CSS_SELECTOR, "#groups .group")} == {str(group)})
        driver.save_screenshot(str(ns.out / "view_tokens_version.png"))
        Select(driver.find_element(By.ID, "colour")).select_by_value("mismatch")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".tok[data-diff]"))
        driver.save_screenshot(str(ns.out / "view_tokens_mismatch.png"))
        driver.get(f"{url}?tab=events")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#events-table tr.event"))
        driver.save_screenshot(str(ns.out / "view_events.png"))
        print(f"step {step}, group {group}: screenshots in {ns.out}/view_*.png")
        if ns.docs:
            ns.docs.mkdir(parents=True, exist_ok=True)
            for name in ("view_curves.png", "view_tokens_version.png"):
                shutil.copyfile(ns.out / name, ns.docs / name)
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
