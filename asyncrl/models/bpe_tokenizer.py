"""A Qwen2.5-sized byte-level BPE tokenizer, built locally (no hub) and cached.

Real-size models need a real-size tokenizer: 151,643 regular tokens (ids 0..151642) plus Qwen's 22
added tokens (<|endoftext|> = 151643, <|im_start|> = 151644, <|im_end|> = 151645, ...,
<|file_sep|> = 151664), so `len(tokenizer) == 151,665` while the model's embedding has 151,936
rows, the same layout as Qwen2.5. The pipeline is Qwen2's (NFC, the same split regex, byte-level
BPE), so encoding works and costs as the real one does; the ids, and how many tokens a given text
takes, differ (the merges are learnt from code, not Qwen's multilingual corpus).

The merges are trained (HF `tokenizers`, ~2 s) on text this machine already has: the Python
standard library's source (code + docstrings) and the synthetic arithmetic task. That text yields
~53k tokens at min_frequency 2, short of 151,643 (256 byte symbols + 151,387 merges), so the
rest (~99k) is filled deterministically: each word-like token (an optional leading byte symbol
then ASCII letters), in id order, extended by each lowercase letter whose concatenation is not yet
a token. Those merges are valid and reachable (a letter run extends a word), just rarely used.

The stdlib differs between Python versions, so the cache key hashes the corpus itself: one cached
tokenizer per (BPE_BUILD_VERSION, corpus). A model directory carries its own copy, so ids only
need to agree within one build.
"""

from __future__ import annotations

import hashlib
import json
import string
import sysconfig
from pathlib import Path

from tokenizers import AddedToken, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from asyncrl.models.tokenizer import CHAT_TEMPLATE, qwen2_pipeline, save_tokenizer

# Bump when the output changes for the same corpus (pipeline, fill rule, special tokens).
BPE_BUILD_VERSION = 1

REGULAR_VOCAB_SIZE = 151_643  # Qwen2.5's BPE vocabulary: ids 0..151642
MODEL_MAX_LENGTH = 131_072
TRAIN_MIN_FREQUENCY = 2

# (content, special) in id order from REGULAR_VOCAB_SIZE; as in Qwen2.5, tool-call and
# fill-in-the-middle markers are added but not special (skip_special_tokens keeps them).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
TOKENIZER_SIZE = REGULAR_VOCAB_SIZE + len(ADDED_TOKENS)  # 151,665
ENDOFTEXT_ID = REGULAR_VOCAB_SIZE  # 151643: Qwen's bos/pad id
IM_START_ID = REGULAR_VOCAB_SIZE + 1
IM_END_ID = REGULAR_VOCAB_SIZE + 2  # 151645: end of an assistant turn, the chat EOS


def corpus_texts() -> list[str]:
    """The training text, in a fixed order: stdlib sources (tests and site-packages left out),
    then every 2-digit sum as the synthetic arithmetic task writes it ("50+13=63"; spelled out
    here because models/ sits below data/)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = sorted(p for p in root.rglob("*.py")
                   if not skip.intersection(p.relative_to(root).parts))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    texts.append("".join(f"{a}+{b}={a + b}\n" for a in range(100) for b in range(100)))
    return texts


def corpus_digest(texts: list[str]) -> str:
    h = hashlib.sha256(f"v{BPE_BUILD_VERSION}\n".encode())
    for text in texts:
        h.update(len(text).to_bytes(8, "little"))
        h.update(text.encode("utf-8", errors="replace"))
    return h.hexdigest()[:12]


def train_merges(texts: list[str], vocab_size: int = REGULAR_VOCAB_SIZE
                 ) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a byte-level BPE trained on `texts`; at most `vocab_size` tokens."""
    tok = qwen2_pipeline(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=TRAIN_MIN_FREQUENCY, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))
              for m in model["merges"]]
    return model["vocab"], merges


def _word_like(token: str) -> bool:
    """An optional leading byte symbol then ASCII letters: what the split regex lets a
    following letter extend."""
    tail = token[1:]
    return bool(tail) and all(c in string.ascii_letters for c in tail)


def fill_merges(vocab: dict[str, int], merges: list[tuple[str, str]], size: int
                ) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """`vocab`/`merges` grown to exactly `size` tokens by the deterministic rule in the module
    docstring. Filled tokens are word-like too and join the queue of stems, so any corpus with
    one word-like token reaches `size`. ValueError if the vocabulary is already larger."""
    if len(vocab) > size:
        raise ValueError(f"vocab size {len(vocab)} is out of range; allowed <= {size}")
    vocab, merges = dict(vocab), list(merges)
    stems = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if _word_like(t)]
    letters = [c for c in string.ascii_lowercase if c in vocab]  # a merge joins two tokens
    i = 0
    while len(vocab) < size:
        if i == len(stems):
            raise ValueError("the vocabulary has no word-like token (a letter run) to extend")
        stem = stems[i]
        i += 1
        for letter in letters:
            token = stem + letter
            if len(vocab) < size and token not in vocab:
                vocab[token] = len(vocab)
                merges.append((stem, letter))
                stems.append(token)
    return vocab, merges


def build_bpe_tokenizer(texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A fresh Qwen2.5-layout tokenizer trained on `texts` (default: `corpus_texts()`)."""
    vocab, merges = train_merges(corpus_texts() if texts is None else texts)
    vocab, merges = fill_merges(vocab, merges, REGULAR_VOCAB_SIZE)
    tok = qwen2_pipeline(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # One call per token keeps each one's flag; ids follow the regular vocabulary in order.
    for content, special in ADDED_TOKENS:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    ids = [tok.token_to_id(c) for c, _ in ADDED_TOKENS]
    if ids != list(range(REGULAR_VOCAB_SIZE, TOKENIZER_SIZE)):
        raise RuntimeError(f"added tokens got ids {ids[:3]}...; expected {REGULAR_VOCAB_SIZE}..")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )


def bpe_tokenizer_dir(texts: list[str] | None = None) -> Path:
    """Where the tokenizer for this corpus is (or will be) cached."""
    from asyncrl.models.loading import cache_root

    digest = corpus_digest(corpus_texts() if texts is None else texts)
    return cache_root() / "tokenizers" / f"qwen2.5-bpe-{digest}"


def ensure_bpe_tokenizer() -> Path:
    """The cached tokenizer directory, built first if absent."""
    from asyncrl.models.loading import build_once

    texts = corpus_texts()
    return build_once(bpe_tokenizer_dir(texts), "tokenizer.json",
                      lambda tmp: save_tokenizer(build_bpe_tokenizer(texts), tmp))


def load_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """The cached Qwen2.5-layout tokenizer (built on first use: ~4 s on 2 cores)."""
    return PreTrainedTokenizerFast.from_pretrained(ensure_bpe_tokenizer(), local_files_only=True)
