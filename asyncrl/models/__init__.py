"""Policy models: load any local HF causal LM + tokenizer, or build the embedded tiny one.

`tokenizer` holds the tiny byte-level tokenizer and its ChatML template, `tiny` builds the small
random-init Qwen2/Llama saved as a standard HF directory, `loading` loads local directories and
caches the tiny model, `chat` encodes chat prompts and completions. Import from the modules:
this package stays light to import.
"""
