"""Policy models: load any local HF causal LM + tokenizer, or build the embedded tiny one.

`tokenizer` holds the character-level tokenizer and its ChatML template, `tiny` builds the small
random-init Qwen2/Llama saved as a standard HF directory, `loading` loads local directories and
caches the tiny model, `chat` encodes chat prompts and completions.
"""

from asyncrl.models.loading import (
    ModelConfig,
    ModelLoadError,
    cache_root,
    check_model_dir,
    default_model_dir,
    ensure_tiny_model,
    load_causal_lm,
    load_tokenizer,
    resolve_model_dir,
)
from asyncrl.models.tiny import (
    TinyModelConfig,
    build_tiny_model,
    build_tiny_model_in_memory,
    count_parameters,
)
from asyncrl.models.export import save_model_dir, save_weights_dir, untied_copy
from asyncrl.models.tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    UNK_TOKEN,
    build_char_tokenizer,
    save_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE", "ENDOFTEXT_TOKEN", "IM_END_TOKEN", "IM_START_TOKEN", "PAD_TOKEN",
    "SPECIAL_TOKENS", "UNK_TOKEN", "ModelConfig", "ModelLoadError", "TinyModelConfig",
    "build_char_tokenizer", "build_tiny_model", "build_tiny_model_in_memory", "cache_root",
    "check_model_dir", "count_parameters", "default_model_dir", "ensure_tiny_model",
    "load_causal_lm", "load_tokenizer", "resolve_model_dir", "save_model_dir", "save_tokenizer",
    "save_weights_dir", "untied_copy",
]
