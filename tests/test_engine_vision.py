"""The built-in engine serving the embedded tiny VLM (Qwen2-VL) with images in the prompt, on the
compact model (vision tower once per prompt, M-RoPE) and on the transformers fallback runner:
per-token logprobs equal the trainer's for the same samples (fp32), versions are stamped as for
text, a weight update mid-generation is followed by the rest of each sequence under the new
weights, and bad requests are refused with the reason."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from asyncrl.api import GenerationConfig, ModelRequest, Sample
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.presets import build_preset_model
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.models.vision import VisionPromptEncoder
from asyncrl.models.tiny_vl import IMAGE_PAD_ID
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_preset_model("tiny-vl", tmp_path_factory.mktemp("tiny-vl"))


def prompt(vl_dir, n: int, size=(112, 112)):
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    for k in range(n):
        draw.ellipse((6 + 25 * k, 30, 26 + 25 * k, 50), fill=("red", "blue", "green")[k % 3])
    return VisionPromptEncoder.from_model_dir(vl_dir).encode(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]}],
        [img])


def request(p, rid: str, tokens: int = 8) -> ModelRequest:
    g = GenerationConfig(max_new_tokens=tokens, min_new_tokens=tokens, temperature=1.0,
                         top_p=1.0, top_k=0, seed=7)
    return ModelRequest(p.input_ids, g, rid=rid, images=p.image_inputs())


def trainer_check(model_dir, prompts, responses) -> None:
    """The trainer's logprobs of each response's tokens equal the engine's (fp32, 1e-4)."""
    samples = []
    for p, r in zip(prompts, responses):
        s = Sample.from_prompt_and_completion(p.input_ids, r.output_tokens, r.output_logprobs,
                                              r.output_versions)
        s.images = p.image_inputs()
        samples.append(s)
    trainer = HFTrainEngine(load_causal_lm(model_dir), TrainEngineConfig(device="cpu"),
                            trainable=False)
    for s, lp in zip(samples, trainer.forward(samples)):
        generated = torch.tensor(s.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(lp[generated], torch.tensor(s.logprobs)[generated],
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_image_prompts_sample_with_the_trainers_logprobs(vl_dir, backend):
    """native: the compact model (M-RoPE, the vision tower once per prompt, decode on the C++
    kernels when a batch shares one rope delta, per row otherwise); hf: the transformers
    fallback. Both against the trainer."""
    engine = LLMEngine(EngineConfig(model_path=str(vl_dir), backend=backend))
    runner = {"native": "ModelRunner", "hf": "HFModelRunner"}[backend]
    assert type(engine.runner).__name__ == runner and engine.max_seq_len == 1024
    # one batch mixing image sizes (two rope deltas), one of equal sizes (one delta), and a
    # text-only prompt beside images
    text = VisionPromptEncoder.from_model_dir(vl_dir).encode(
        [{"role": "user", "content": "Count to three."}])
    batches = [[prompt(vl_dir, 2), prompt(vl_dir, 3, (112, 56)), text],
               [prompt(vl_dir, 1), prompt(vl_dir, 3)]]
    for k, prompts in enumerate(batches):
        responses = engine.generate([request(p, f"r{k}.{i}") for i, p in enumerate(prompts)])
        assert all(len(r.output_tokens) == 8 and set(r.output_versions) == {0}
                   for r in responses)
        trainer_check(vl_dir, prompts, responses)


def test_the_vision_tower_runs_once_per_prompt(vl_dir):
    engine = LLMEngine(EngineConfig(model_path=str(vl_dir)))
    tower = engine.runner.vision.module
    calls = []
    tower.register_forward_hook(lambda *_: calls.append(1))
    p = prompt(vl_dir, 2)
    engine.generate([request(p, f"g{i}") for i in range(4)])  # a group: one ImageInputs object
    assert len(calls) == 1
    engine.generate([request(prompt(vl_dir, 3), "other")])
    assert len(calls) == 2


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_weight_update_mid_generation_continues_each_sequence(vl_dir, tmp_path, backend):
    """Tokens sampled before the update carry version 0 and v0's logprobs, the rest version 1
    and v1's (the sequence is recomputed under v1, images included: the cached vision output
    of v0 is not reused)."""
    engine = LLMEngine(EngineConfig(model_path=str(vl_dir), backend=backend))
    p = prompt(vl_dir, 1)
    engine.add_request(request(p, "mid", tokens=6))
    for _ in range(3):
        engine.step()
    model = load_causal_lm(vl_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.01)
    engine.update_weights_from_state_dict(model.state_dict(), version=1)
    done = []
    while not done:
        done = engine.step()
    r = done[0]
    assert len(r.output_versions) == 6 and r.output_versions[0] == 0
    assert r.output_versions[-1] == 1 and r.output_versions == sorted(r.output_versions)
    v1_dir = tmp_path / "v1"
    model.save_pretrained(v1_dir)
    for version, model_dir in ((0, vl_dir), (1, v1_dir)):
        idx = [i for i, v in enumerate(r.output_versions) if v == version]
        samples = Sample.from_prompt_and_completion(p.input_ids, r.output_tokens,
                                                    r.output_logprobs, r.output_versions)
        samples.images = p.image_inputs()
        trainer = HFTrainEngine(load_causal_lm(model_dir), TrainEngineConfig(device="cpu"),
                                trainable=False)
        lp = trainer.forward([samples])[0][torch.tensor(samples.loss_mask, dtype=torch.bool)]
        torch.testing.assert_close(lp[idx], torch.tensor(r.output_logprobs)[idx], atol=1e-4,
                                   rtol=0)


def test_requests_the_engine_cannot_serve_are_refused(vl_dir, tmp_path):
    p = prompt(vl_dir, 2)
    engine = LLMEngine(EngineConfig(model_path=str(vl_dir)))
    first_pad = p.input_ids.index(IMAGE_PAD_ID)
    short = ModelRequest(p.input_ids[:first_pad] + p.input_ids[first_pad + 4:],
                         images=p.image_inputs())  # 4 of its 16 image tokens dropped
    with pytest.raises(ValueError, match="image tokens but its images' grids need 16"):
        engine.add_request(short)
    # image tokens without the images (a prompt encoded as text): refused here, not a failed
    # step for every request batched with it
    with pytest.raises(ValueError, match="has 16 image tokens but its images' grids need 0"):
        engine.add_request(ModelRequest(p.input_ids))
    text = LLMEngine(EngineConfig(model_path=str(build_tiny_model(TinyModelConfig(),
                                                                  tmp_path / "text"))))
    with pytest.raises(ValueError, match="text-only model; a prompt with images needs"):
        text.add_request(ModelRequest([5, 6, 7], images=p.image_inputs()))


def test_backends_without_images_refuse_them(vl_dir):
    import asyncio

    from asyncrl.inference.backends import BACKENDS
    from asyncrl.inference.config import RemoteEngineConfig
    from asyncrl.inference.remote import RemoteInferenceEngine

    p = prompt(vl_dir, 1)
    for kind in ("asyncrl", "sglang"):
        remote = RemoteInferenceEngine(RemoteEngineConfig(addresses=["http://127.0.0.1:9"]),
                                       BACKENDS.parse(kind).build())
        with pytest.raises(ValueError, match=f"the {kind} backend sends no images"):
            asyncio.run(remote.agenerate(ModelRequest(p.input_ids, images=p.image_inputs())))


def test_vllm_image_call_collapses_pads_and_sends_the_pixels_losslessly(vl_dir):
    """The body of vLLM's token-in route for a prompt with images (the live server is in
    tests/integration/test_vllm_vision.py): one pad per image, PNG data URLs the image processor
    turns into the very pixels the prompt carries, and a generated pad ends the call."""
    from asyncrl.inference.backends import BACKENDS
    from asyncrl.models.vision import VisionPromptEncoder, load_image

    p = prompt(vl_dir, 2)
    images = p.image_inputs()
    g = GenerationConfig(max_new_tokens=5, stop_token_ids=(7,))
    call = BACKENDS.parse("vllm").build(images=True).generate_call(p.input_ids + [9, 9], g, "r1",
                                                                  stream=True, images=images)
    assert call.path == "/inference/v1/generate"
    body = call.json
    pad = images.pad_id
    assert p.input_ids.count(pad) > 1 and body["token_ids"].count(pad) == 1
    ids = p.input_ids + [9, 9]
    assert body["token_ids"] == [t for i, t in enumerate(ids) if t != pad or ids[i - 1] != pad]
    # a generated vision token ends the call (the trainer reads it as id 0, vLLM as itself)
    assert body["sampling_params"]["stop_token_ids"] == [7, *images.vision_ids]
    assert pad in images.vision_ids and len(images.vision_ids) == 4
    assert body["request_id"] == "r1" and body["stream"] is True
    urls = [part["url"] for part in body["content_parts"]]
    pixels, grid = VisionPromptEncoder.from_model_dir(vl_dir).process([load_image(u) for u in urls])
    assert torch.equal(pixels, images.pixel_values) and torch.equal(grid, images.grid_thw)


def test_vllm_parses_the_token_in_routes_events():
    from asyncrl.api import StopReason
    from asyncrl.inference.backends import BACKENDS

    backend = BACKENDS.parse("vllm").build()
    event = {"request_id": "generate-tokens-r1", "choices": [{
        "index": 0, "token_ids": [5, 6], "finish_reason": "abort",
        "logprobs": {"content": [{"token_id": 5, "logprob": -0.5, "top_logprobs": []},
                                 {"token_id": 6, "logprob": -1.5, "top_logprobs": []}]}}]}
    delta = backend.parse_stream_event(event)
    assert (delta.tokens, delta.logprobs, delta.stop_reason) == ([5, 6], [-0.5, -1.5],
                                                                 StopReason.ABORT)
    seg = backend.parse_generate({"choices": [{**event["choices"][0], "finish_reason": "stop"}]})
    assert (seg.tokens, seg.logprobs, seg.stop_reason) == ([5, 6], [-0.5, -1.5], StopReason.STOP)
    assert backend.abort_call("r1").json == {"request_ids": ["cmpl-r1-0",
                                                             "generate-tokens-r1"]}
