"""Tokenizers the tests build on purpose: one token per character in a WordLevel vocabulary, as
the embedded model's tokenizer was before it became byte-level (a qwen2 directory holding one
loads lossily under transformers 5), or without spaces (lossy by itself)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncrl.models.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS


def word_level_tokenizer(chars: Iterable[str]) -> PreTrainedTokenizerFast:
    """Special tokens 0..4, then one id per character of `chars`; anything else is <|unk|>."""
    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *chars))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                   pad_token="<|pad|>", unk_token="<|unk|>",
                                   chat_template=CHAT_TEMPLATE)
