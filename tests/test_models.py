"""Models: byte tokenizer + chat template, tiny model builder, local loading, tiny-model cache."""

from __future__ import annotations

import json
import re
import unicodedata

import jinja2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.api import GenerationConfig
from asyncrl.config import ConfigError
from asyncrl.models import loading
from asyncrl.models.loading import ModelLoadError, default_model_dir, ensure_tiny_model, load_causal_lm, load_tokenizer, resolve_model_dir
from asyncrl.models.config import ModelConfig
from asyncrl.models.tiny import build_tiny_model, build_tiny_model_in_memory
from asyncrl.models.config import TinyModelConfig
from asyncrl.models.tokenizer import build_byte_tokenizer, save_tokenizer
from asyncrl.models.chat import stop_at_eos
from asyncrl.models.tokenizer import CHARACTERS, SPECIAL_TOKENS

TEXT = st.text(alphabet=st.sampled_from(CHARACTERS), max_size=200)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "tool", "content": "{\"ok\": true}"},
]
RENDERED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\n2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4<|im_end|>\n"
    "<|im_start|>tool\n{\"ok\": true}<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def reloaded(tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(tokenizer, out)
    return AutoTokenizer.from_pretrained(out, local_files_only=True), out


# ---- tokenizer ----------------------------------------------------------------------------------

def test_special_tokens_have_fixed_ids_and_are_single_tokens(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    for i, tok in enumerate(SPECIAL_TOKENS):
        a, b = tokenizer.encode("a")[0], tokenizer.encode("b")[0]
        assert tokenizer.encode(f"a{tok}b") == [a, i, b]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 3, 4)
    assert len(tokenizer) == 5 + 256  # one id per byte


def test_no_bos_is_prepended_and_other_text_is_bytes(tokenizer):
    assert tokenizer.encode("ab") == tokenizer.encode("a") + tokenizer.encode("b")
    assert len(tokenizer.encode("ab")) == 2
    # ASCII keeps its ids (newline 5, space 6, "!".."~" 7..100); other bytes are 101..260
    assert tokenizer.encode("\n !~") == [5, 6, 7, 100]
    ids = tokenizer.encode("a\té日")
    assert len(ids) == 1 + 1 + 2 + 3 and all(100 < i < 261 for i in ids[1:])
    assert tokenizer.decode(ids) == "a\té日"


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_round_trips_without_unk(tokenizer, reloaded, text):
    ids = tokenizer.encode(text)
    assert 4 not in ids
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)  # Qwen2's normaliser
    assert reloaded[0].encode(text) == ids


@settings(max_examples=50, deadline=None)
@given(text=TEXT)
def test_round_trip_is_exact(tokenizer, reloaded, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    if not any(tok in text for tok in SPECIAL_TOKENS):
        assert len(ids) == len(text)  # one id per character
        assert 4 not in ids
    assert reloaded[0].encode(text) == ids


def test_saved_tokenizer_is_portable_and_identical(tokenizer, reloaded):
    tok2, out = reloaded
    config = json.loads((out / "tokenizer_config.json").read_text())
    # Inline template and a class both 4.x and 5.x know: loadable by the transformers a vLLM
    # release pins.
    assert config["chat_template"] == tokenizer.chat_template
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    specials = (tok2.pad_token_id, tok2.eos_token_id, tok2.unk_token_id, tok2.bos_token)
    assert specials == (0, 3, 4, None)
    text = "<|im_start|>user\nhi there, 1 + 2 = 3?<|im_end|>\n"
    assert tok2.encode(text) == tokenizer.encode(text)
    assert tok2.apply_chat_template(MESSAGES, tokenize=False) == RENDERED


# ---- chat template ------------------------------------------------------------------------------

def test_chat_template_renders_chatml_exactly(tokenizer):
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == RENDERED
    prompt = tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == RENDERED.split("<|im_start|>assistant")[0] + "<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)
    assert ids == tokenizer.encode(RENDERED)
    assert ids.count(2) == 4 and ids.count(3) == 4  # markers are single special ids


def test_chat_template_accepts_text_parts_and_none_content(tokenizer):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts},
                {"role": "assistant", "content": None}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"


CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"},
                                                    "base": {"type": "integer"}}}}}


def test_chat_template_renders_tools_compactly_into_the_system_block(tokenizer):
    tools = [CALC_TOOL, {"type": "function", "function": {"name": "now"}}]
    rendered = tokenizer.apply_chat_template(MESSAGES[:2], tools=tools, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.\n\n# Tools\ncalc(expr,base)\nnow()<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
    )
    no_system = tokenizer.apply_chat_template(MESSAGES[1:2], tools=tools[1:], tokenize=False)
    assert no_system == ("<|im_start|>system\n# Tools\nnow()<|im_end|>\n"
                         "<|im_start|>user\n2+2?<|im_end|>\n")


def test_chat_template_renders_tool_calls_exactly(tokenizer):
    # The proxy parses `<tool_call>(.*?)</tool_call>` back out of generations: this text is the
    # contract between SFT data, the template and the parser.
    calls = [
        {"id": "a", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2+2"}'}},
        {"id": "b", "type": "function", "function": {"name": "calc",
                                                      "arguments": {"expr": "3*4", "n": [1, 2]}}},
    ]
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": None, "tool_calls": calls[:1]},
                {"role": "tool", "tool_call_id": "a", "content": "4"},
                {"role": "assistant", "content": "so", "tool_calls": calls[1:]},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "assistant", "content": "4", "tool_calls": []}]
    rendered = tokenizer.apply_chat_template(messages, tools=[CALC_TOOL], tokenize=False)
    assert rendered == (
        "<|im_start|>system\n# Tools\ncalc(expr,base)<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name":"calc","arguments":{"expr": "2+2"}}</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>tool\n4<|im_end|>\n"
        '<|im_start|>assistant\nso<tool_call>{"name":"calc","arguments":{"expr":"3*4","n":[1,2]}}'
        "</tool_call><|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name":"calc","arguments":{"expr": "2+2"}}</tool_call>'
        '<tool_call>{"name":"calc","arguments":{"expr":"3*4","n":[1,2]}}</tool_call><|im_end|>\n'
        "<|im_start|>assistant\n4<|im_end|>\n"
    )
    body = re.findall(r"<tool_call>(.*?)</tool_call>", rendered)
    assert [json.loads(b) for b in body] == [
        {"name": "calc", "arguments": {"expr": "2+2"}},
        {"name": "calc", "arguments": {"expr": "3*4", "n": [1, 2]}},
    ] * 2


def test_chat_template_rejects_unknown_role(tokenizer):
    with pytest.raises(jinja2.TemplateError, match="got robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_stop_at_eos_adds_eos_once_and_keeps_the_rest(tokenizer):
    eos = tokenizer.eos_token_id
    others = [eos + 20, eos + 10]  # not sorted, and neither is EOS
    g = GenerationConfig(greedy=True, max_new_tokens=7, stop_token_ids=others, stop=["END"])
    out = stop_at_eos(g, tokenizer)
    assert out.stop_token_ids == [*others, eos]  # the caller's order, EOS last
    assert g.stop_token_ids == [eos + 20, eos + 10]  # the input is not modified
    assert (out.greedy, out.max_new_tokens, out.stop) == (True, 7, ["END"])
    assert stop_at_eos(out, tokenizer) is out  # already there: nothing to add
    assert stop_at_eos(GenerationConfig(), tokenizer).stop_token_ids == [eos]

    class NoEos:
        eos_token_id = None

    assert stop_at_eos(g, NoEos()) is g


# ---- tiny model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_saves_and_loads_with_identical_logits(arch, tmp_path):
    cfg = TinyModelConfig(arch=arch)
    model, tokenizer = build_tiny_model_in_memory(cfg)
    out = build_tiny_model(cfg, tmp_path / arch)
    assert out == tmp_path / arch
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ids = torch.tensor([tokenizer.encode("<|im_start|>user\n12+34=?<|im_end|>\n")])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        assert torch.equal(load_causal_lm(out)(ids).logits, model(ids).logits)
    text = "What is 12 + 34? <|im_end|>\n"  # spaces: a model-type tokenizer class drops them
    assert load_tokenizer(out).encode(text) == tokenizer.encode(text)

    config = json.loads((out / "config.json").read_text())
    expected_arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    assert config["architectures"] == [expected_arch] and config["model_type"] == arch
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert config["rope_theta"] == 10000.0
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (3, 0, 1)
    assert config["vocab_size"] == 320  # 261 ids padded to a multiple of 64
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 3
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_default_tiny_model_has_about_6m_parameters():
    model, _ = build_tiny_model_in_memory(TinyModelConfig())
    count = sum(p.numel() for p in model.parameters())  # tied embeddings count once
    assert count == 6_381_824  # the number quoted in tiny.py's docstring
    assert 5_000_000 <= count <= 7_000_000


def test_same_seed_same_weights_and_caller_rng_untouched():
    small = dict(hidden_size=64, num_layers=2, intermediate_size=128)
    torch.manual_seed(123)
    a, _ = build_tiny_model_in_memory(TinyModelConfig(**small))
    after_build = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after_build)  # the build did not consume the caller's RNG
    b, _ = build_tiny_model_in_memory(TinyModelConfig(**small))
    c, _ = build_tiny_model_in_memory(TinyModelConfig(**small, seed=1))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_tiny_config_validation_names_fields():
    with pytest.raises(ValueError, match=r"hidden_size=250 must be divisible by num_heads=4"):
        TinyModelConfig(hidden_size=250, num_heads=4)
    with pytest.raises(ValueError, match=r"num_heads=4 must be divisible by num_kv_heads=3"):
        TinyModelConfig(num_kv_heads=3)
    with pytest.raises(ConfigError, match="hidden_size"):
        TinyModelConfig.from_dict({"hidden_size": 0})
    with pytest.raises(ConfigError, match="did you mean 'num_layers'"):
        TinyModelConfig.from_dict({"num_layer": 2})
    with pytest.raises(ConfigError, match="arch"):
        TinyModelConfig.from_dict({"arch": "gpt2"})


# ---- loading ------------------------------------------------------------------------------------

def test_missing_dir_and_non_model_dir_raise_model_load_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=re.escape(f"model dir {missing} not found")):
        load_causal_lm(missing)
    with pytest.raises(ModelLoadError, match="not found"):
        load_tokenizer(missing)
    no_config = re.escape(f"{tmp_path} has no config.json; expected a HF model")
    with pytest.raises(ModelLoadError, match=no_config):
        load_causal_lm(tmp_path)
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_dir(ModelConfig(path=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ModelLoadError, match="cannot load model weights"):
        load_causal_lm(tmp_path)
    with pytest.raises(ModelLoadError, match="has no tokenizer files"):
        load_tokenizer(tmp_path)
    assert issubclass(ModelLoadError, ValueError)


def test_load_causal_lm_dtype(tmp_path):
    small = TinyModelConfig(hidden_size=64, num_layers=1, intermediate_size=64)
    out = build_tiny_model(small, tmp_path)
    assert load_causal_lm(out, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='int8'.*allowed: float32, bfloat16, float16"):
        load_causal_lm(out, dtype="int8")
    with pytest.raises(ConfigError, match="dtype"):
        ModelConfig.from_dict({"dtype": "int8"})


def test_ensure_tiny_model_builds_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    cfg = TinyModelConfig(hidden_size=64, num_layers=1, intermediate_size=64)
    out = ensure_tiny_model(cfg)
    assert out == default_model_dir(cfg) and out.parent == tmp_path / "models"
    assert out.name.startswith("tiny-") and (out / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [out.name]  # no temp dir left

    def no_rebuild(*args, **kwargs):
        raise AssertionError("cached model was rebuilt")

    monkeypatch.setattr(loading, "build_tiny_model", no_rebuild)
    assert ensure_tiny_model(cfg) == out
    assert resolve_model_dir(ModelConfig(), cfg) == out
    assert default_model_dir(cfg.model_copy(update={"seed": 1})) != out
    assert default_model_dir() == tmp_path / "models" / default_model_dir().name


def test_ensure_tiny_model_replaces_a_half_written_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path))
    cfg = TinyModelConfig(hidden_size=64, num_layers=1, intermediate_size=64)
    stale = default_model_dir(cfg)
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"truncated")
    out = ensure_tiny_model(cfg)
    assert out == stale and (out / "config.json").is_file()
    load_causal_lm(out)
