"""The agent proxy with a vision-language policy, over real HTTP with the real `openai` client:
`image_url` parts (a data URL, a file URL under the proxy's image_dir) reach the built-in engine
as the request's images; the recorded prompt is what the trainer's encoder gives; a second turn
with a new image continues the first turn's sampled ids; and the exported samples replay in the
trainer with the sampler's logprobs (fp32, 1e-4). URLs the proxy does not read are a 400 naming
why, and a text-only policy refuses image parts."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch
from PIL import Image, ImageDraw
from proxy_helpers import serving

from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.models.loading import load_causal_lm, load_tokenizer
from asyncrl.models.presets import build_preset_model
from asyncrl.models.vision import VisionPromptEncoder
from asyncrl.proxy.config import ProxyConfig
from asyncrl.proxy.export import export_session
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine

ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_preset_model("tiny-vl", tmp_path_factory.mktemp("tiny-vl"))


def scene(n: int) -> Image.Image:
    img = Image.new("RGB", (112, 112), (123, 117, 104))
    draw = ImageDraw.Draw(img)
    for k in range(n):
        draw.rectangle((4 + 27 * k, 40, 22 + 27 * k, 58), fill=("red", "blue", "green")[k % 3])
    return img


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(url: str, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def proxy(vl_dir, tmp_path_factory):
    images = tmp_path_factory.mktemp("images")
    scene(3).save(images / "three.png")
    engine = AsyncLLMEngine(EngineConfig(model_path=str(vl_dir)))
    cfg = ProxyConfig(admin_key="admin-secret", max_tokens_cap=16, image_dir=str(images))
    with serving(engine, load_tokenizer(vl_dir), cfg, context_length=512,
                 vision=VisionPromptEncoder.from_model_dir(vl_dir)) as (server, _):
        yield server, images
    engine.shutdown()


def session(server) -> dict:
    r = httpx.post(f"{server.url}/sessions", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def test_image_parts_are_recorded_across_turns_and_replay_in_the_trainer(vl_dir, proxy):
    server, images = proxy
    s = session(server)
    client = openai.OpenAI(base_url=server.base_url, api_key=s["api_key"], max_retries=0)
    first = [user(data_url(scene(2)), "How many?")]
    one = client.chat.completions.create(model="default", messages=first, max_tokens=4,
                                         temperature=1.0, seed=3)
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      user(f"file://{images / 'three.png'}", "And here?")]
    client.chat.completions.create(model="default", messages=second, max_tokens=4,
                                   temperature=1.0, seed=4)

    encoder = VisionPromptEncoder.from_model_dir(vl_dir)
    completions = list(server.store.get(s["session_id"]).completions.values())
    zero = {c.id: 0.0 for c in completions}
    turn1, turn2 = export_session(completions, zero, zero, "individual")
    want = encoder.encode([{"role": "user", "content": [{"type": "image", "image": scene(2)},
                                                        {"type": "text", "text": "How many?"}]}])
    assert turn1.input_ids[:len(want.input_ids)] == want.input_ids
    assert turn1.images.digest == want.image_inputs().digest
    # the second prompt continues the first turn's sampled ids, then holds both images
    head = turn1.input_ids
    assert turn2.input_ids[:len(head)] == head
    both = encoder.process([scene(2), Image.open(images / "three.png").convert("RGB")])
    assert turn2.images.grid_thw.tolist() == both[1].tolist()
    torch.testing.assert_close(turn2.images.pixel_values, both[0])
    pads = encoder.pad_id
    # placeholders in the prompt parts only: a random model may sample an <|image_pad|> id,
    # which is read as text
    sampled = {i for i, m in enumerate(turn1.loss_mask) if m}
    prompt = [t for i, (t, m) in enumerate(zip(turn2.input_ids, turn2.loss_mask))
              if not m and i not in sampled]
    assert prompt.count(pads) == sum(encoder.tokens_per_image(both[1]))

    # the trainer reads each recorded sample (and the whole conversation) with the sampler's
    # logprobs
    concat = export_session(completions, zero, zero, "concat")
    assert len(concat) == 1 and concat[0].images.digest == turn2.images.digest
    trainer = HFTrainEngine(load_causal_lm(vl_dir), TrainEngineConfig(device="cpu"),
                            trainable=False)
    samples = [turn1, turn2, concat[0]]
    for smp, lp in zip(samples, trainer.forward(samples)):
        mask = torch.tensor(smp.loss_mask, dtype=torch.bool)
        assert mask.any()
        torch.testing.assert_close(lp[mask], torch.tensor(smp.logprobs)[mask], atol=1e-4,
                                   rtol=0)
    r = httpx.post(f"{server.url}/sessions/{s['session_id']}/export", headers=ADMIN,
                   json={"style": "individual"})
    assert [x["image_digest"] for x in r.json()["samples"]] == [turn1.images.digest,
                                                               turn2.images.digest]


@pytest.mark.parametrize("url,reason", [
    ("file:///etc/hostname", "outside the directory this proxy reads images from"),
    ("https://example.com/cat.png", "allowed a data:image/...;base64 URL or a file:// URL"),
    ("data:image/png;base64,AAAA", "cannot be decoded"),
])
def test_urls_the_proxy_does_not_read_are_a_400_naming_why(proxy, url, reason):
    server, _ = proxy
    s = session(server)
    client = openai.OpenAI(base_url=server.base_url, api_key=s["api_key"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=[user(url, "How many?")],
                                       max_tokens=2)
    assert reason in str(err.value)


def test_a_text_only_policy_refuses_image_parts(model_dir):
    engine = AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=256))
    try:
        with serving(engine, load_tokenizer(model_dir), ProxyConfig(admin_key="admin-secret"),
                     context_length=256) as (server, _):
            s = session(server)
            client = openai.OpenAI(base_url=server.base_url, api_key=s["api_key"],
                                   max_retries=0)
            with pytest.raises(openai.BadRequestError, match="vision-language policy"):
                client.chat.completions.create(
                    model="default", messages=[user(data_url(scene(1)), "How many?")],
                    max_tokens=2)
    finally:
        engine.shutdown()


def test_anthropic_image_blocks_and_responses_input_images_reach_the_policy(vl_dir, proxy):
    """The same images through /v1/messages (a base64 image block, with the anthropic SDK) and
    /v1/responses (an input_image part): recorded with the prompt the trainer's encoder gives."""
    anthropic = pytest.importorskip("anthropic")
    server, _ = proxy
    s = session(server)
    url = data_url(scene(2))
    encoder = VisionPromptEncoder.from_model_dir(vl_dir)
    want = encoder.encode([{"role": "user", "content": [{"type": "image", "image": scene(2)},
                                                        {"type": "text", "text": "How many?"}]}])
    msg = anthropic.Anthropic(base_url=server.url, api_key=s["api_key"], max_retries=0)
    reply = msg.messages.create(model="default", max_tokens=4, messages=[{
        "role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": url.split(",", 1)[1]}},
            {"type": "text", "text": "How many?"}]}])
    client = openai.OpenAI(base_url=server.base_url, api_key=s["api_key"], max_retries=0)
    resp = client.responses.create(model="default", max_output_tokens=4, input=[{
        "role": "user", "content": [{"type": "input_image", "image_url": url},
                                    {"type": "input_text", "text": "How many?"}]}])
    stored = server.store.get(s["session_id"]).completions
    for cid in (reply.id, resp.id):
        c = stored[cid]
        assert c.prompt_ids == want.input_ids and c.images.digest == want.image_inputs().digest
