"""Run with a server venv's python: how that venv's loaders tokenize texts from model directories.

    VENV_PYTHON tokenizer_probe.py REQUEST.json

REQUEST.json: {"loader": "vllm" | "sglang", "dirs": [model dir, ...], "texts": [text, ...],
"messages": [chat messages]}. Prints one JSON object: for each directory, for each loader
(`auto`: AutoTokenizer.from_pretrained; `server`: the server's own get_tokenizer; `processor`:
AutoProcessor's tokenizer, where the directory has a preprocessor_config.json), the class, the
ids of every text, each decode, and the chat template's rendering of the messages; an
"error" in place of a loader that raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def server_loader(kind: str):
    if kind == "vllm":
        from vllm.tokenizers import get_tokenizer
    else:
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer
    return get_tokenizer


def describe(tokenizer, texts: list[str], messages: list[dict]) -> dict:
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return {"class": type(tokenizer).__name__, "ids": ids,
            "decoded": [tokenizer.decode(i, skip_special_tokens=False) for i in ids],
            "rendered": tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)}


def main() -> None:
    from transformers import AutoProcessor, AutoTokenizer

    request = json.loads(Path(sys.argv[1]).read_text())
    loaders = {"auto": AutoTokenizer.from_pretrained,
               "server": server_loader(request["loader"]),
               "processor": lambda d: AutoProcessor.from_pretrained(d).tokenizer}
    out = {}
    for d in request["dirs"]:
        out[d] = {}
        for name, load in loaders.items():
            if name == "processor" and not (Path(d) / "preprocessor_config.json").is_file():
                continue
            try:
                out[d][name] = describe(load(d), request["texts"], request["messages"])
            except Exception as err:  # reported to the test, which names the loader
                out[d][name] = {"error": f"{type(err).__name__}: {err}"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
