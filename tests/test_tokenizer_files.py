"""Every model directory asyncrl writes loads with `AutoTokenizer` into the tokenizer asyncrl uses.

Users' workflows, TRL, transformers pipelines and the servers load a tokenizer with
`AutoTokenizer.from_pretrained(model_dir)`, and transformers picks its class from the model type
(in 5.x it rebuilds a qwen2 directory as `Qwen2Tokenizer` from the vocabulary alone). These tests
load each kind of directory that way and check that the chat template's text comes back exactly
and that the ids equal asyncrl's own loader's and the tokenizer.json's. `.ci/run` runs this file
and tests/test_models.py at both ends of the supported transformers range
(tests/transformers_floor.py); the vLLM and SGLang suites load the same directories with their
venvs' loaders (tests/integration/test_server_tokenizers.py).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import textwrap

import pytest
import transformers
from tokenizers import Tokenizer
from transformers import AutoImageProcessor, AutoTokenizer

from tokenizer_helpers import word_level_tokenizer

from asyncrl import Trainer
from asyncrl.launch.train_config import TrainRunConfig
from asyncrl.models.bpe_tokenizer import ensure_bpe_tokenizer
from asyncrl.models.config import TinyModelConfig
from asyncrl.models.loading import load_tokenizer
from asyncrl.models.presets import build_preset_model, preset_hf_config
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.tokenizer import CHARACTERS
from asyncrl.models.tokenizer_check import TokenizerMismatchError

CONVERSATION = [
    {"role": "system", "content": "You add numbers.  Answer with the sum."},
    {"role": "user", "content": "What is 64 + 65?\nThink, then answer."},
    {"role": "assistant", "content": "64 + 65 = 129\n#### 129"},
    {"role": "tool", "content": "{\"ok\": true, \"value\": [1, 2]}"},
]
TEXTS = [
    "<|im_start|>user\n64 + 65 =<|im_end|>\n<|im_start|>assistant\n",
    "  two  spaces, a tab\tand\r\nCRLF; don't stop: x = [1, 2]  \n\n",
    "héllo wörld, 日本語 and ✓",
]
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{kind: model dir} for every builder asyncrl has: the `build-model` presets (tiny, the
    tiny Llama variant, tiny-vl) and the Qwen2.5 presets' tokenizer with their config (the
    0.5B's weights would only add a minute of writing)."""
    root = tmp_path_factory.mktemp("written")
    dirs = {"tiny": build_preset_model("tiny", root / "tiny"),
            "tiny-llama": build_tiny_model(TinyModelConfig(arch="llama"), root / "tiny-llama"),
            "tiny-vl": build_preset_model("tiny-vl", root / "tiny-vl")}
    qwen = root / "qwen2.5-0.5b"
    shutil.copytree(ensure_bpe_tokenizer(), qwen)
    preset_hf_config("qwen2.5-0.5b").save_pretrained(qwen)
    dirs["qwen2.5-0.5b"] = qwen
    return dirs


def check_same_tokenizer(model_dir, ours=None):
    """AutoTokenizer's tokenizer of `model_dir` gives every text back exactly and the ids of
    asyncrl's loader (or `ours`) and of the raw tokenizer.json; the chat template renders the
    same text."""
    auto = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ours = ours or load_tokenizer(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rendered = auto.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.apply_chat_template(CONVERSATION, tokenize=False,
                                                add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 64 + 65?\nThink, then answer.<|im_end|>\n" in rendered
    for text in [rendered, *TEXTS]:
        ids = auto.encode(text, add_special_tokens=False)
        assert auto.decode(ids, skip_special_tokens=False) == text
        assert ids == ours.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text, add_special_tokens=False).ids
    return auto


@pytest.mark.parametrize("kind", ["tiny", "tiny-llama", "tiny-vl", "qwen2.5-0.5b"])
def test_every_preset_loads_with_autotokenizer_exactly(written, kind):
    auto = check_same_tokenizer(written[kind])
    config = json.loads((written[kind] / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer" and "chat_template" in config
    assert auto.eos_token == "<|im_end|>"


@pytest.mark.parametrize("kind", ["tiny", "tiny-vl"])
def test_a_tokenizer_resaved_by_transformers_stays_the_same(written, kind, tmp_path):
    """The copy a user makes (AutoTokenizer + save_pretrained, next to the model's config)
    loads back to the same tokenizer: the trap of a char-level vocabulary rewritten as
    byte-level, which dropped every space, cannot happen."""
    copy = tmp_path / kind
    copy.mkdir()
    shutil.copy(written[kind] / "config.json", copy)
    AutoTokenizer.from_pretrained(written[kind]).save_pretrained(copy)
    check_same_tokenizer(copy, ours=load_tokenizer(written[kind]))


def test_the_vlm_processor_files_load(written):
    vl = written["tiny-vl"]
    image = AutoImageProcessor.from_pretrained(vl)
    assert type(image).__name__.startswith("Qwen2VLImageProcessor")
    assert image.size["longest_edge"] == 112 * 112  # max_pixels
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("AutoProcessor needs torchvision for Qwen2-VL's video processor, and no "
                    "torchvision build matches this CPU torch; the vLLM suite loads it in its "
                    "venv (tests/integration/test_server_tokenizers.py)")
    processor = transformers.AutoProcessor.from_pretrained(vl)
    check_same_tokenizer(vl, ours=processor.tokenizer)


def char_level_dir(tmp_path, model_dir):
    """A directory as asyncrl wrote before its tokenizer was byte-level: a WordLevel vocabulary
    of one token per character under a qwen2 config, declared as the generic class."""
    out = tmp_path / "char-level"
    out.mkdir()
    shutil.copy(model_dir / "config.json", out)
    word_level_tokenizer(CHARACTERS).save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def test_a_directory_autotokenizer_loads_lossily_is_refused(written, tmp_path):
    old = char_level_dir(tmp_path, written["tiny"])
    auto = AutoTokenizer.from_pretrained(old)
    lossy = auto.decode(auto.encode("a b\nc", add_special_tokens=False)) != "a b\nc"
    assert lossy == TRANSFORMERS_5  # 5.x rebuilds every qwen2 directory as Qwen2Tokenizer
    if not lossy:
        assert load_tokenizer(old).decode(load_tokenizer(old).encode("a b\nc")) == "a b\nc"
        return
    with pytest.raises(TokenizerMismatchError) as err:
        load_tokenizer(old)
    message = str(err.value)
    assert "Qwen2Tokenizer" in message and str(old) in message
    assert "Hello,world!12+34=46" in message  # what the servers and users' code would see
    assert "AutoTokenizer.from_pretrained" in message


OUTSIDE_WORKFLOW = '''
"""A researcher's workflow, outside the package, that loads its tokenizer the HF way."""
import asyncio

from transformers import AutoTokenizer

from asyncrl import GenerationConfig, ModelRequest, Sample, Trajectory

PROMPTS = []  # the text of every prompt the workflow sent, decoded back


class ChatWorkflow:
    def __init__(self, model_dir, n=4):
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.n, self.gconfig = n, GenerationConfig(max_new_tokens=6)

    async def arun_episode(self, engine, data):
        text = self.tokenizer.apply_chat_template(data["messages"], tokenize=False,
                                                  add_generation_prompt=True)
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        PROMPTS.append((text, self.tokenizer.decode(prompt)))
        replies = await asyncio.gather(*(
            engine.agenerate(ModelRequest(input_ids=prompt, gconfig=self.gconfig))
            for _ in range(self.n)))
        # a random model answers noise; a digit in the reply varies within a group
        samples = [Sample.from_prompt_and_completion(
            prompt, r.output_tokens, r.output_logprobs, r.output_versions,
            reward=float(any(c.isdigit() for c in self.tokenizer.decode(r.output_tokens))),
            stop_reason=r.stop_reason) for r in replies]
        return Trajectory(samples, group_id=str(data.get("id", "")))
'''


def test_a_workflow_that_loads_its_tokenizer_with_autotokenizer_trains(written, tmp_path,
                                                                        monkeypatch):
    """3 steps of the main job (configs/train_tiny.yaml) with a workflow module written outside
    the package that loads its tokenizer with AutoTokenizer. The policy is the random tiny
    model rather than the SFT warm start (minutes to train), so the workflow's reward is one a
    random model varies on; what is checked is that its prompts are the chat template's text,
    newlines kept, and the ids asyncrl's own loader gives."""
    plugin_dir = tmp_path / "outside"
    plugin_dir.mkdir()
    (plugin_dir / "outside_workflow.py").write_text(textwrap.dedent(OUTSIDE_WORKFLOW))
    monkeypatch.syspath_prepend(str(plugin_dir))
    model_dir = written["tiny"]
    cfg = TrainRunConfig.load("configs/train_tiny.yaml", [
        f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}", "total_steps=3",
        "max_train_seconds=null", "rollout.batch_size=4", "rollout.max_concurrent_rollouts=8",
        "eval.every=0", "checkpoint_every=3", "logging.tensorboard=false",
        "inference.engine.device=cpu", "train.device=cpu",
        "workflow.path=outside_workflow:ChatWorkflow", f"workflow.kwargs.model_dir={model_dir}"])
    result = Trainer(cfg).train()
    assert result.steps == 3
    prompts = sys.modules["outside_workflow"].PROMPTS
    assert prompts and all(text == back for text, back in prompts)
    assert all(text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n"
               "<|im_start|>assistant\n") for text, _ in prompts)
    ours = load_tokenizer(model_dir)
    text = prompts[0][0]
    assert (AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)
            == ours.encode(text, add_special_tokens=False))
    # the checkpoint the run wrote loads the same way
    policy = next((tmp_path / "run" / "checkpoints").glob("step_*/policy"))
    check_same_tokenizer(policy, ours=ours)
