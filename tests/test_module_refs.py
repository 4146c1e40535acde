"""Every module path in configs/, examples/*/*.yaml and the README's code blocks imports.

A config comment that told users to import `asyncrl.train.weight_sync` (a module that does not
exist) is the failure this catches: the paths are collected by tests/module_refs.py and each one
is imported here, with its attribute looked up (vLLM's and SGLang's in their venvs' suites).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from module_refs import ROOT, SERVER_PACKAGES, all_refs, config_refs

REFS = [r for r in all_refs() if r.package not in SERVER_PACKAGES]


def test_the_collector_finds_the_paths_it_should():
    sources = {r.module for r in config_refs()}
    assert "asyncrl.models.export" in sources  # the gsm8k config's comment
    assert "examples.own_model.rewards" in sources  # configs/train_hf.yaml's reward
    assert "examples.math_agent.agent" in sources
    assert {r.package for r in all_refs()} >= {"asyncrl", "vllm", "sglang"}


@pytest.mark.parametrize("ref", REFS, ids=[f"{r.source}:{r.module}" for r in REFS])
def test_it_imports(ref, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # examples.* import from the repository root
    try:
        module = importlib.import_module(ref.module)
    except ImportError as err:
        pytest.fail(f"{ref.source} names {ref.module}, which does not import: {err}")
    if ref.attr is not None and not hasattr(module, ref.attr):
        # `from pkg import sub` may name a submodule
        if importlib.util.find_spec(f"{ref.module}.{ref.attr}") is None:
            pytest.fail(f"{ref.source} names {ref.module}:{ref.attr}; {ref.module} has no "
                        f"{ref.attr}")
    assert ref.module in sys.modules
