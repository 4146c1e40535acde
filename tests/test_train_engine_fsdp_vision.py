"""FSDP2 on 2 gloo ranks (one torchrun launch) training the embedded tiny Qwen2-VL on samples
with images: the decoder layers are sharded (the vision tower goes with the root), and one step
on 2 ranks equals one step on one process (loss, the weights of the vision tower and the
language model, the trained logprobs)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from asyncrl.api.trajectory import Sample
from asyncrl.models.loading import load_causal_lm
from asyncrl.models.presets import build_preset_model
from asyncrl.models.vision import VisionPromptEncoder
from asyncrl.train.config import OptimizerConfig, TrainEngineConfig
from asyncrl.train.engine import HFTrainEngine, sft_token_loss

CFG = TrainEngineConfig(device="cpu", optimizer=OptimizerConfig(lr=1e-3, eps=1e-6))


def make_samples(model_dir) -> list[Sample]:
    """Four prompts, each with its own image (sizes differ), one completion each: two per rank."""
    encoder = VisionPromptEncoder.from_model_dir(model_dir)
    out = []
    for n, size in ((1, (112, 112)), (2, (112, 56)), (3, (56, 112)), (4, (112, 112))):
        img = Image.new("RGB", size, "white")
        draw = ImageDraw.Draw(img)
        for k in range(n):
            draw.rectangle((4 + 12 * k, 4, 12 + 12 * k, 20), fill=("red", "blue")[k % 2])
        prompt = encoder.encode([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "How many?"}]}], [img])
        completion = [ord(str(n)) - 26, 3]
        sample = Sample.from_prompt_and_completion(prompt.input_ids, completion, [-1.0, -1.0],
                                                   [0, 0])
        sample.images = prompt.image_inputs()
        out.append(sample)
    return out


def one_step(engine: HFTrainEngine, model_dir) -> dict:
    stats = engine.train_batch(make_samples(model_dir), sft_token_loss)
    return {"stats": stats, "logprobs": engine.forward(make_samples(model_dir)),
            "state": engine.model_state_dict()}


def _worker(model_dir: str, out: str) -> None:
    from asyncrl.train.fsdp import FSDP2

    torch.set_num_threads(1)
    engine = HFTrainEngine(load_causal_lm(model_dir), CFG, parallel=FSDP2("cpu"))
    result = one_step(engine, model_dir)
    if engine.parallel.rank == 0:
        torch.save(result, out)
    torch.distributed.barrier()  # both ranks done before the group goes away
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_fsdp_two_ranks_with_images_equal_one_process(tmp_path):
    model_dir = build_preset_model("tiny-vl", tmp_path / "tiny-vl")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
           "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), __file__,
           str(model_dir), str(tmp_path / "fsdp.pt")]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = one_step(HFTrainEngine(load_causal_lm(model_dir), CFG), model_dir)
    finally:
        torch.set_num_threads(before)
    assert ranks["stats"]["train/loss"] == pytest.approx(single["stats"]["train/loss"], rel=1e-5)
    assert any(".visual." in f".{k}" for k in single["state"])
    for name, value in single["state"].items():
        torch.testing.assert_close(ranks["state"][name], value, atol=1e-6, rtol=0, msg=name)
    for got, want in zip(ranks["logprobs"], single["logprobs"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
