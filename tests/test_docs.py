"""The documentation site builds: `mkdocs build --strict` (Material theme, mkdocstrings) over
docs/ fails on a broken link, a missing anchor, a page left out of the nav or an API entry that
does not resolve; and README.md's relative links point at files that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()
    for page in (ROOT / "docs" / "results").glob("*.md"):  # generated tables render as tables
        generated = page.read_text().count("<!-- generated: ")
        html = (tmp_path / "site" / "results" / page.stem / "index.html").read_text()
        assert html.count("<table>") >= generated, (
            f"a generated table in {page.name} does not render as a table")


def test_the_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    assert len(text.splitlines()) <= 250


def test_every_config_field_the_pages_name_exists():
    """A dotted key in backticks (`actor.ppo.eps_clip`, `data.path=...`) whose first part is a
    run-config section names a field of some kind of that section (the changelog, which also
    names fields that do not exist, is left out)."""
    from test_config_docs import VARIANTS

    from asyncrl.config_docs import walk_fields
    from asyncrl.launch.train_config import TrainRunConfig

    keys: set[str] = set()
    for overrides in [*VARIANTS, ["workflow.kind=tool_calls", "data.kind=arithmetic_submit"],
                      ["launcher=ray"], ["inference.mode=local"], ["train.lora.enabled=true"],
                      ["actor.advantage.estimator=gae"],
                      ["data.kind=counting", "warm_start.tiny.arch=qwen2_vl"],
                      ["data.kind=parquet", "data.path=x"]]:
        keys |= {d.key for d in walk_fields(TrainRunConfig.load(None, overrides))}
    sections = {k.split(".")[0] for k in keys}
    named = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+)(?:[=:][^`]*)?`")
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        if page.name == "changelog.md":
            continue
        for key in named.findall(page.read_text()):
            if key.split(".")[0] in sections and key not in keys and not any(
                    k.startswith(key + ".") for k in keys):
                missing.append(f"{page.relative_to(ROOT)}: {key}")
    assert not missing, missing


def test_the_api_reference_covers_every_exported_name():
    import asyncrl

    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    missing = [n for n in asyncrl.__all__
               if n != "__version__" and f"heading: asyncrl.{n}\n" not in page + "\n"]
    assert not missing, f"docs/reference/api.md has no entry for {missing}"


def test_the_results_pages_tables_match_their_records():
    """Every `<!-- generated: NAME -->` table of docs/results/ is what
    benchmarks/results_pages.py makes of the records in benchmarks/results/ now."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "results_pages.py"),
                          "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + out.stdout
