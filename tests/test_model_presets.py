"""Qwen2.5-shaped presets and the Qwen2.5-layout BPE tokenizer (models/presets.py,
models/bpe_tokenizer.py), and `asyncrl build-model`.

The default suite checks the preset numbers (parameters counted on the meta device) and the
tokenizer's layout on a small corpus (the fill makes it full size anyway); the `slow` tests build
the real 0.5B preset with the full-corpus tokenizer and load it with transformers and our engine.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.cli import main
from asyncrl.models import bpe_tokenizer as bpe
from asyncrl.models.presets import (
    check_preset,
    ensure_preset_model,
    preset_hf_config,
)

# From Qwen/Qwen2.5-0.5B-Instruct and Qwen/Qwen2.5-1.5B-Instruct config.json.
PUBLISHED = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960),
}
COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
              tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False,
              bos_token_id=151643, eos_token_id=151645, model_type="qwen2")
PARAMS = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304}  # model cards: 0.49B, 1.54B


def _rope_theta(cfg) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    return rope.get("rope_theta", getattr(cfg, "rope_theta", None))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_the_published_architecture(name):
    cfg = preset_hf_config(name)
    for key, value in {**PUBLISHED[name], **COMMON}.items():
        assert getattr(cfg, key) == value, key
    assert _rope_theta(cfg) == 1_000_000.0
    assert cfg.architectures == ["Qwen2ForCausalLM"]
    with torch.device("meta"):  # counted without allocating anything
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]


def test_unknown_preset_and_dtype_are_rejected_by_name():
    with pytest.raises(ValueError, match=r"preset='qwen2.5-05b'.*did you mean 'qwen2.5-0.5b'"):
        check_preset("qwen2.5-05b")
    with pytest.raises(ValueError, match=r"dtype='fp8'.*allowed"):
        preset_hf_config("qwen2.5-0.5b", dtype="fp8")


SMALL_CORPUS = [
    "def add(a, b):\n    return a + b\n\nclass Counter:\n    \"\"\"Counts things.\"\"\"\n",
    "The quick brown fox jumps over the lazy dog. 12+30=42\n" * 3,
]
MESSAGES = [{"role": "system", "content": "You solve sums."},
            {"role": "user", "content": "What is 12+30? Réponds en 中文."},
            {"role": "assistant", "content": "42"}]


@pytest.fixture(scope="module")
def small_tokenizer():
    return bpe.build_bpe_tokenizer(SMALL_CORPUS)


def test_tokenizer_has_qwen25_layout(small_tokenizer):
    tok = small_tokenizer
    assert len(tok) == bpe.TOKENIZER_SIZE == 151_665
    assert tok.backend_tokenizer.get_vocab_size(with_added_tokens=False) == 151_643
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                     "<tool_call>", "<|file_sep|>"])
    assert ids == [151643, 151644, 151645, 151657, 151664]
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token) == (151645, 151643, None)
    # Tool-call markers stay in decoded text without special tokens, as in Qwen2.5.
    ids = tok.encode("<tool_call>{}</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call>"


def test_tokenizer_round_trips_text_and_chat(small_tokenizer, tmp_path):
    bpe.save_tokenizer(small_tokenizer, tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "x = {'k': [1, 2]}\r\n\tü ñ 漢字 🙂  end\n\n"
    assert tok.decode(tok.encode(text)) == text
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert rendered == ("<|im_start|>system\nYou solve sums.<|im_end|>\n"
                        "<|im_start|>user\nWhat is 12+30? Réponds en 中文.<|im_end|>\n"
                        "<|im_start|>assistant\n42<|im_end|>\n")
    ids = tok.apply_chat_template(MESSAGES, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids.count(151644) == 3 and ids.count(151645) == 3
    assert tok.decode(ids) == rendered
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"


def test_fill_is_exact_deterministic_and_valid():
    vocab = {c: i for i, c in enumerate("abcdeĠ")}
    vocab.update({"Ġa": 6, "ab": 7})
    merges = [("Ġ", "a"), ("a", "b")]
    v1, m1 = bpe.fill_merges(vocab, merges, 500)
    v2, m2 = bpe.fill_merges(vocab, merges, 500)
    assert (v1, m1) == (v2, m2)
    assert len(v1) == 500 and sorted(v1.values()) == list(range(500))
    assert len(m1) == 500 - 6
    for left, right in m1:  # every merge joins two tokens into a third
        assert left in v1 and right in v1 and left + right in v1
    with pytest.raises(ValueError, match="allowed <= 3"):
        bpe.fill_merges(vocab, merges, 3)


def test_cli_build_model_tiny_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["build-model", "--preset", "tiny", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert main(["build-model", "--preset", "tiny", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["build-model", "--preset", "tiny", "--force", str(out)]) == 0
    assert main(["build-model", "--preset", "qwen2.5-05b", str(out)]) == 2
    assert "did you mean 'qwen2.5-0.5b'" in capsys.readouterr().err


# ---- slow: the real 0.5B preset with the full-corpus tokenizer ---------------------------------


@pytest.fixture(scope="module")
def qwen05b_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("ASYNCRL_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        yield ensure_preset_model("qwen2.5-0.5b")
    finally:
        mp.undo()


@pytest.mark.slow
def test_qwen05b_loads_with_transformers(qwen05b_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(qwen05b_dir, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == PARAMS["qwen2.5-0.5b"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.generation_config.eos_token_id == [151645, 151643]
    tok = AutoTokenizer.from_pretrained(qwen05b_dir)
    assert len(tok) == 151_665
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False)
    ids = tok.apply_chat_template(MESSAGES, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.decode(ids) == rendered
    # Whatever class transformers picks for model_type qwen2, the ids are the saved tokenizer's.
    from asyncrl.models.loading import load_tokenizer

    assert load_tokenizer(qwen05b_dir).encode(rendered) == tok.encode(rendered)


@pytest.mark.slow
def test_qwen05b_is_cached(qwen05b_dir):
    stamp = (qwen05b_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_preset_model("qwen2.5-0.5b") == qwen05b_dir
    assert (qwen05b_dir / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_builtin_engine_generates_on_qwen05b(qwen05b_dir):
    """fp32: the engine's logprobs of its greedy tokens equal HF's on the same sequence."""
    from asyncrl.api import GenerationConfig, ModelRequest
    from asyncrl.inference.engine import EngineConfig, LLMEngine
    from asyncrl.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(qwen05b_dir)
    prompt = tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    engine = LLMEngine(EngineConfig(model_path=str(qwen05b_dir), dtype="float32",
                                    max_seq_len=64, max_num_seqs=2))
    out = engine.generate([ModelRequest(prompt, GenerationConfig(max_new_tokens=4,
                                                                 greedy=True))])[0]
    assert len(out.output_tokens) == 4
    assert all(0 <= t < 151_936 for t in out.output_tokens)
    model = load_causal_lm(qwen05b_dir, dtype="float32")
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.output_tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    hf = logprobs.gather(1, torch.tensor(out.output_tokens)[:, None])[:, 0]
    assert torch.allclose(hf, torch.tensor(out.output_logprobs), atol=2e-3)
    assert out.output_tokens[0] == int(logprobs[0].argmax())
