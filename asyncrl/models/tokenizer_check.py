"""Refuse a tokenizer that loses text: a model directory `AutoTokenizer` reads lossily, and a
job whose chat-rendered prompts do not come back from encode/decode.

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
import re
from collections.abc import Mapping, Sequence
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


def check_chat_round_trip(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                          template_kwargs: Mapping[str, Any], where: str) -> None:
    """TokenizerMismatchError when the chat template's rendering of `messages` does not come
    back from encode then decode: characters, spaces or newlines lost, or a special token split
    (whitespace next to a special token may differ, as some tokenizers normalise it)."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=True, **template_kwargs)
    back = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False),
                            skip_special_tokens=False, clean_up_tokenization_spaces=False)
    specials = sorted({t for t in tokenizer.all_special_tokens if t} | set(
        getattr(tokenizer, "added_tokens_encoder", {})), key=len, reverse=True)
    split = re.compile("|".join(map(re.escape, specials))) if specials else None

    def parts(s: str) -> list[str]:
        pieces = split.split(s) if split else [s]
        marks = split.findall(s) if split else []
        return [p.strip() for p in pieces] + marks

    if parts(text) != parts(back):
        raise TokenizerMismatchError(
            f"{where}: the tokenizer ({type(tokenizer).__name__}) does not give back the chat "
            f"template's text: {text[:200]!r} came back as {back[:200]!r}, so the model would "
            "be trained on other text than the template renders; use a tokenizer whose "
            "decode(encode(text)) keeps spaces, newlines and special tokens")
