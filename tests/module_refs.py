"""The module paths the repository's configs and documents name, collected for import tests.

A config file's values (`reward: pkg.mod:fn`, `workflow.path`, `plugins`, ...) and its comments'
commands (`python -c "from pkg import name"`, `python -m pkg.mod`), and the code blocks of
README.md and the docs site's pages (shell commands, Python snippets, and `pkg.mod:name` paths into
this repository or an installed package). tests/test_module_refs.py imports those of this environment; the vLLM and SGLang
suites import `vllm.*` / `sglang.*` in their venvs (tests/integration/test_server_tokenizers.py).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG_FILES = sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("examples/*/*.yaml")])
SERVER_PACKAGES = ("vllm", "sglang")  # live in their own venvs
OURS = ("asyncrl", "examples")

MODULE_ATTR = re.compile(r"^(?:trl:)?([A-Za-z_]\w*(?:\.\w+)*):([A-Za-z_]\w*)$")
INLINE_ATTR = re.compile(r"(?<![\w/.:])((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*):([A-Za-z_]\w*)\b")
FROM_IMPORT = re.compile(r"\bfrom\s+([A-Za-z_][\w.]*)\s+import\s+([\w, ]+)")
IMPORT = re.compile(r"^\s*import\s+([A-Za-z_][\w.]*)")
DASH_M = re.compile(r"(?:python3?|torchrun)\b[^\n]*?\s-m\s+([A-Za-z_][\w.]*)")


@dataclass(frozen=True)
class ModuleRef:
    source: str  # file:line
    module: str
    attr: str | None = None

    @property
    def package(self) -> str:
        return self.module.split(".")[0]


def _from_text(text: str, source: str) -> list[ModuleRef]:
    """References in commands and code: -m modules, import statements."""
    refs = [ModuleRef(source, m) for m in DASH_M.findall(text)]
    for module, names in FROM_IMPORT.findall(text):
        refs += [ModuleRef(source, module, n.strip()) for n in names.split(",") if n.strip()]
    refs += [ModuleRef(source, m) for m in IMPORT.findall(text)]
    return refs


def _yaml_values(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for value in node.values() for v in _yaml_values(value)]
    if isinstance(node, list):
        return [v for value in node for v in _yaml_values(value)]
    return [node] if isinstance(node, str) else []


def config_refs() -> list[ModuleRef]:
    """Every module path a config file names, in a value or a comment's command."""
    refs = []
    for path in CONFIG_FILES:
        rel = path.relative_to(ROOT)
        text = path.read_text()
        for value in _yaml_values(yaml.safe_load(text)):
            if m := MODULE_ATTR.match(value.strip()):
                refs.append(ModuleRef(f"{rel}", m.group(1), m.group(2)))
        for i, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("#"):
                refs += _from_text(line.lstrip("# "), f"{rel}:{i}")
    return refs


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def readme_refs() -> list[ModuleRef]:
    """The code blocks of README.md and docs/: commands and Python imports, plus `pkg.mod:name`
    paths into this repository or an installed package (`my_pkg.rewards:score` is an
    illustration)."""
    refs = []
    for doc in DOCUMENTS:
        text, rel = doc.read_text(), doc.relative_to(ROOT)
        for match in re.finditer(r"```(\w*)\n(.*?)```", text, re.S):
            start = text[:match.start()].count("\n") + 2
            for i, line in enumerate(match.group(2).splitlines()):
                source = f"{rel}:{start + i}"
                refs += _from_text(line, source)
                for module, attr in INLINE_ATTR.findall(line):
                    ref = ModuleRef(source, module, attr)
                    if ref.package in OURS or importlib.util.find_spec(ref.package) is not None:
                        refs.append(ref)
    return refs


def all_refs() -> list[ModuleRef]:
    return config_refs() + readme_refs()
