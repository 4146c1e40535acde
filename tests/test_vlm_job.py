"""The training job on a vision-language model: `asyncrl`'s Trainer with the embedded tiny VLM
(`build-model --preset tiny-vl`) and the counting task (rows with images) runs rollouts with the
images on the in-process engine, trains on them, evaluates and checkpoints, and a resume
continues from the checkpoint. (Learning to count within minutes needs the SFT warm start of a
later step; this checks the path, not the accuracy.)"""

from __future__ import annotations

import json

import pytest
from test_train_loop import metrics, small_config

from PIL import Image

from asyncrl import Trainer
from asyncrl.launch.evaluate import run_eval_job
from asyncrl.launch.sft import run_sft_job
from asyncrl.launch.sft_config import SFTRunConfig
from asyncrl.launch.train_config import TrainRunConfig
from asyncrl.models.presets import build_preset_model
from asyncrl.models.vision import VisionPromptEncoder
from asyncrl.rollout.answer_eval import EvalConfig


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_preset_model("tiny-vl", tmp_path_factory.mktemp("tiny-vl"))


def counting_config(vl_dir, out, **over):
    return small_config(vl_dir, out, **{"data": {"kind": "counting", "num_train": 64,
                                                 "num_eval": 8, "max_objects": 4},
                                        "gconfig.max_new_tokens": 3, **over})


@pytest.mark.slow
def test_a_vlm_trains_on_images_and_resumes(vl_dir, tmp_path):
    run = tmp_path / "run"
    # the logprob canary after every push: its prompts carry their images too
    result = Trainer(counting_config(vl_dir, run,
                                     **{"inference.check_logprobs_every": 1})).train()
    assert result.steps == 3 and result.final_accuracy is not None
    steps = [m for m in metrics(run) if "perf/train_s" in m]
    assert len(steps) == 3 and all(m["batch/tokens"] > 0 for m in steps)
    checked = [m["weight_check/max_abs_diff"] for m in steps if "weight_check/max_abs_diff" in m]
    assert len(checked) == 3 and max(checked) < 1e-3
    dumped = [json.loads(line) for f in sorted((run / "rollouts").glob("*.jsonl"))
              for line in f.read_text().splitlines()]
    assert dumped and all(d["answer"].isdigit() and len(d["image_digest"]) == 16 for d in dumped)
    assert (run / "checkpoints" / "latest").exists()
    # the checkpoint's policy loads as the base did: with its image processor
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (latest / "policy" / "preprocessor_config.json").is_file()
    VisionPromptEncoder.from_model_dir(latest / "policy")
    # `asyncrl eval` on the checkpoint: greedy accuracy and pass@k with the images
    evaluated = run_eval_job(latest / "policy", "{kind: counting, num_eval: 4, max_objects: 3}",
                             EvalConfig(max_new_tokens=3, pass_k=[2]), reward="clevr_count_70k")
    assert evaluated.num_problems == 4 and set(evaluated.pass_at_k) == {2}
    # the evaluations, drawn: the eval rows' scenes with the model's answers
    for name in ("eval_grid_initial.png", "eval_grid.png"):
        with Image.open(run / name) as grid:
            assert grid.size[0] == 4 * 160 and grid.size[1] > 2 * 160
    resumed = Trainer(counting_config(vl_dir, run, total_steps=4)).train(resume=True)
    assert resumed.steps == 4


def test_the_warm_start_trains_the_embedded_vlm_on_images(tmp_path):
    """`tiny.arch: qwen2_vl` builds the embedded VLM; SFT encodes each row's image into its
    sample, trains, evaluates greedily with the images and saves a directory that loads with its
    image processor."""
    cfg = SFTRunConfig.from_dict({
        "tiny": {"arch": "qwen2_vl"},
        "data": {"kind": "counting", "num_train": 16, "num_eval": 4, "max_objects": 3},
        "sft": {"steps": 2, "batch_size": 4, "eval_size": 4, "eval_max_new_tokens": 2},
        "output_dir": str(tmp_path / "sft")})
    result = run_sft_job(cfg)
    assert result.steps == 2 and result.eval_size == 4 and 0 <= result.eval_accuracy <= 1
    encoder = VisionPromptEncoder.from_model_dir(result.model_dir)
    assert encoder.tokenizer.convert_tokens_to_ids("<|image_pad|>") == encoder.pad_id
    assert run_sft_job(cfg).cached


def test_image_data_with_a_text_model_is_refused_when_the_config_loads():
    with pytest.raises(ValueError, match="tiny.arch='qwen2'.*text-only.*qwen2_vl"):
        SFTRunConfig.from_dict({"data": {"kind": "counting"}})
    with pytest.raises(ValueError, match="warm_start.tiny.arch='qwen2'.*text-only"):
        TrainRunConfig.from_dict({"data": {"kind": "counting"}})


def test_a_row_whose_image_cannot_be_decoded_is_rejected_and_the_run_goes_on(vl_dir, tmp_path,
                                                                             caplog):
    """One train row and one eval row of a jsonl file carry a corrupt image: the rollout of the
    train row is rejected with its reason, the eval leaves its row out and says so, the rest
    trains."""
    import base64
    import io

    from asyncrl.data.counting import CountingTaskConfig

    def data_url(img) -> str:
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    scenes = CountingTaskConfig(num_train=12, num_eval=0, max_objects=3).build().train_rows()
    broken = "data:image/png;base64,AAAA"
    lines = [{"id": r["id"], "question": "<image>How many objects are there?",
              "answer": r["answer"], "images": [data_url(r["images"][0])]} for r in scenes]
    lines[0]["images"], lines[-1]["images"] = [broken], [broken]
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(x) + "\n" for x in lines[:8]))
    evals.write_text("".join(json.dumps(x) + "\n" for x in lines[8:]))
    run = tmp_path / "run"
    cfg = counting_config(vl_dir, run, data={"kind": "jsonl", "path": str(train),
                                             "eval_path": str(evals)},
                          total_steps=2, **{"eval.size": 4})
    result = Trainer(cfg).train()
    assert result.steps == 2
    evals_logged = [m for m in metrics(run) if "eval/skipped_problems" in m]
    assert evals_logged and all(m["eval/skipped_problems"] == 1 and m["eval/num_problems"] == 3
                                for m in evals_logged)
    rejected = [r.getMessage() for r in caplog.records if "cannot be decoded" in r.getMessage()]
    assert rejected and "on data id=" in rejected[0]


def test_an_agent_shows_the_policy_images_through_the_proxy_and_trains(vl_dir, tmp_path):
    """workflow kind agent on image rows: the agent sends each scene as an image_url part; the
    recorded samples carry the image and train."""
    run = tmp_path / "run"
    cfg = counting_config(vl_dir, run, total_steps=1, workflow={
        "kind": "agent", "path": "tests.agents_for_tests:ImageAgent"},
        **{"eval.every": 0, "rollout.dump_dir": str(run / "rollouts")})
    assert Trainer(cfg).train().steps == 1
    dumped = [json.loads(line) for f in sorted((run / "rollouts").glob("*.jsonl"))
              for line in f.read_text().splitlines()]
    assert dumped and all(len(d["image_digest"]) == 16 for d in dumped)


def test_lora_on_the_language_model_trains_a_vlm_job(vl_dir, tmp_path):
    """`train.lora` on a VLM: the adapter (named as transformers 5 names the model in memory,
    model.language_model.*) merges into base weights read from the checkpoint (model.*), and
    the engine's canary after each push agrees with the trainer."""
    run = tmp_path / "run"
    result = Trainer(counting_config(vl_dir, run, **{"train.lora.r": 4,
                                                     "inference.check_logprobs_every": 1})).train()
    assert result.steps == 3
    checked = [m["weight_check/max_abs_diff"] for m in metrics(run)
               if "weight_check/max_abs_diff" in m]
    assert len(checked) == 3 and max(checked) < 1e-3
