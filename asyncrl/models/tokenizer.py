"""The byte-level tokenizer of the embedded tiny model, with a ChatML chat template.

The tiny vocabulary is byte-level BPE in Qwen2's own format with no merges: one token per byte,
so ASCII text is one token per character (small embedding, every token boundary obvious when
debugging rollouts) and any text round-trips. The pipeline (NFC, Qwen2's split regex, byte-level
pre-tokenizer and decoder) is exactly the one transformers' `Qwen2Tokenizer` rebuilds from a
directory's vocabulary, so `AutoTokenizer.from_pretrained(model_dir)` gives the same tokenizer on
every transformers version, whichever class it picks, and so do vLLM's and SGLang's loaders. The
ids of the special tokens, "\n" and printable ASCII are fixed (0..100); the other bytes follow.
The chat markup follows Qwen's ChatML so that code written against the tiny model (prompt
rendering, stop tokens, the proxy) also works on real checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, \
    pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

PAD_TOKEN = "<|pad|>"
ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"

# Order fixes the ids (0..4); model configs and tests rely on them, so append, never reorder.
SPECIAL_TOKENS = (PAD_TOKEN, ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)
PAD_ID, ENDOFTEXT_ID, IM_START_ID, IM_END_ID, UNK_ID = range(len(SPECIAL_TOKENS))

# "\n" plus printable ASCII, ids 5..100: enough for chat text, arithmetic, code and JSON tool
# calls; the other 160 bytes (ids 101..260) spell anything else.
CHARACTERS = ("\n", *(chr(c) for c in range(32, 127)))
_FIRST_BYTES = tuple(ord(c) for c in CHARACTERS)
BYTE_ORDER = (*_FIRST_BYTES, *(b for b in range(256) if b not in _FIRST_BYTES))
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(BYTE_ORDER)  # 261

# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX): contractions,
# letter runs with one optional leading symbol, single digits, punctuation runs, newlines, other
# whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def qwen2_pipeline(model: models.Model) -> Tokenizer:
    """`model` inside Qwen2's byte-level pipeline (what transformers' Qwen2Tokenizer builds)."""
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    return tok


# Qwen-style ChatML. Whitespace control (`{{-`, `{%-`) keeps every byte of the output explicit in
# the string literals, so the rendered prompt is exactly what the tests spell out. Content may be
# a string, None (an assistant turn that only calls tools) or a list of OpenAI-style text parts.
# Tools render as one `name(param,...)` line each: the model reads characters, and a JSON schema
# per tool would add ~200 tokens to every sequence. An assistant's tool calls render as
# `<tool_call>{"name":...,"arguments":...}</tool_call>` right after its content, the exact text the
# proxy parses back out of generations (arguments kept verbatim when they are already a string).
TEXT_PART = "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
# With images (models/tiny_vl.py): an image part renders as Qwen2-VL's placeholder, which becomes
# one <|image_pad|> per merged patch of that image before the model sees it (as Qwen2-VL's
# processor does).
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT_OR_IMAGE_PART = ("{%- if part.type == 'text' -%}{{- part.text -}}"
                      "{%- elif part.type in ['image', 'image_url'] -%}{{- '" + IMAGE_PLACEHOLDER
                      + "' -}}{%- endif -%}")



CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}{%- for part in content -%}"
    + TEXT_PART +
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro render_tool(tool) -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{%- set params = fn.parameters if fn.parameters is defined and fn.parameters else {} -%}"
    "{%- set props = params.properties if params.properties is defined and params.properties"
    " else {} -%}"
    "{{- fn.name + '(' + (props | list | join(',')) + ')' -}}"
    "{%- endmacro -%}"
    "{%- macro render_tool_call(call) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- set args = fn.arguments if fn.arguments is defined and fn.arguments is not none"
    " else {} -%}"
    "{{- '<tool_call>{\"name\":' + (fn.name | tojson) + ',\"arguments\":' -}}"
    "{%- if args is string -%}{{- args -}}"
    "{%- else -%}{{- args | tojson(separators=(',', ':')) -}}{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endmacro -%}"
    "{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- render_content(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n' -}}"
    "{%- for tool in tools -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}{{- render_tool(tool) -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('chat role must be one of system, user, assistant, tool; got '"
    " + message.role) -}}"
    "{%- endif -%}"
    # With tools the system prompt was already merged into the tools block above.
    "{%- if not (tools and loop.first and has_system) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) -}}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined"
    " and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}{{- render_tool_call(call) -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def chat_template(part: str = TEXT_PART) -> str:
    """CHAT_TEMPLATE with `part` rendering each part of a list content (TEXT_OR_IMAGE_PART: a
    vision-language model's)."""
    return CHAT_TEMPLATE.replace(TEXT_PART, part)


def _byte_backend() -> Tokenizer:
    symbols = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *(symbols[b] for b in BYTE_ORDER)))}
    # No merges: every byte is its own token. No unk: every byte is in the vocabulary.
    tok = qwen2_pipeline(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    # Added tokens are matched before pre-tokenisation, so "<|im_end|>" in text is one id,
    # not ten bytes; they keep their vocab ids 0..4.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tiny tokenizer: ids 0..4 special, 5..100 "\\n" and ASCII 32..126, 101..260 the
    other bytes (one token per byte).

    pad=<|pad|>, eos=<|im_end|> (the end of an assistant turn, where generation stops), unk=<|unk|>
    (never produced: every byte has an id); no BOS token is prepended (like Qwen), so
    `encode(text)` is just the bytes.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=_byte_backend(),
        pad_token=PAD_TOKEN,
        eos_token=IM_END_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        # Cleanup would turn "a ." into "a." on decode and break the exact round trip.
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """`tokenizer.save_pretrained`, readable by transformers 4.x as well as 5.x.

    vLLM and SGLang pin their own transformers, often 4.x. transformers 5 records the class as
    "TokenizersBackend" (unknown to 4.x) and moves the chat template to chat_template.jinja
    (ignored before ~4.50); the class is recorded as "Qwen2Tokenizer" (the pipeline is Qwen2's,
    so the class transformers picks for a qwen2 model is right by construction) and the template
    stays inline.
    """
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    config_file = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        config["tokenizer_class"] = "Qwen2Tokenizer"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
