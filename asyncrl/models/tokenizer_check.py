"""Refuse a model directory whose tokenizer loses text under `AutoTokenizer`.

transformers picks the tokenizer class from the model type and, in 5.x, rebuilds some classes'
pipelines from the vocabulary alone (every qwen2 directory becomes a `Qwen2Tokenizer`, whatever
its tokenizer.json says). A tokenizer.json in another format then loads into a tokenizer that
silently drops characters (a char-level vocabulary under Qwen2's byte-level pipeline loses every
space and newline). vLLM, SGLang, TRL and users' own workflows all load with `AutoTokenizer`, so
asyncrl loads the same way and refuses, before anything trains, a directory where that loses
text its own tokenizer.json keeps.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from asyncrl.errors import UserError

# Spaces (single, double, leading), newlines, digits and punctuation (printable ASCII only, which
# any vocabulary has): what a prompt or an answer holds.
PROBE = "Hello, world!\n  12 + 34 = 46\ndone: {\"a\": [1, 2]}  end\n\n"


class TokenizerMismatchError(UserError):
    """`AutoTokenizer` loads a directory into a tokenizer that does not give back text the
    directory's own tokenizer.json does; the message names the class, the text and the fix."""


def check_round_trip(tokenizer: Any, model_dir: Path) -> None:
    """Raise TokenizerMismatchError when `tokenizer` (as AutoTokenizer loaded it from
    `model_dir`) loses characters of PROBE that the directory's tokenizer.json keeps."""
    ours = tokenizer.decode(tokenizer.encode(PROBE, add_special_tokens=False),
                            skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if ours == PROBE:
        return
    file = model_dir / "tokenizer.json"
    if not file.is_file() or not _file_round_trips(str(file), file.stat().st_mtime_ns):
        return  # the files themselves lose text (e.g. lower-casing): nothing to compare with
    raise TokenizerMismatchError(
        f"model dir {model_dir}: transformers loads its tokenizer as "
        f"{type(tokenizer).__name__}, which turns {PROBE!r} into {ours!r}, while the directory's "
        "tokenizer.json gives the text back exactly. vLLM, SGLang and any code that calls "
        "AutoTokenizer.from_pretrained would see different prompts than its tokenizer.json "
        "describes. Save a tokenizer whose tokenizer.json is in the format transformers expects "
        "for this model type (for a qwen2 model: byte-level BPE, as `asyncrl build-model` "
        "writes), e.g. by rebuilding the directory with this version of asyncrl")


@functools.lru_cache(maxsize=32)
def _file_round_trips(path: str, _mtime_ns: int) -> bool:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(path)
    return raw.decode(raw.encode(PROBE, add_special_tokens=False).ids,
                      skip_special_tokens=False) == PROBE
