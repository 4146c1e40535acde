"""Datasets by HF conventions: `kind: hf` through the real `datasets.load_dataset`, from a hub
cache built here the way huggingface_hub lays it out (datasets--org--name/snapshots/<commit>,
refs/main) and read with HF_HUB_OFFLINE=1, and from local directories; plus the shared record
mapping (TRL `prompt` column, nested answer paths, system prompt, a row's own `messages`) on
the local jsonl/parquet kinds. No hub is reachable here, so the online (download) path is not
exercised: only the cached/offline one."""

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.data import DatasetError, parse_dataset_config
from asyncrl.data.records import RecordFields, to_row
from asyncrl.config import ConfigError

MAIN, OLD = "a" * 40, "b" * 40  # two commits of the cached repo; refs/main -> MAIN

CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# toy math
"""


def trl_rows(pairs):
    """verl/TRL layout: conversational `prompt` and a nested ground truth."""
    return {
        "prompt": [[{"role": "user", "content": f"What is {q}?"}] for q, _ in pairs],
        "reward_model": [{"ground_truth": a, "style": "rule"} for _, a in pairs],
        "data_source": ["toy"] * len(pairs),
    }


def write_snapshot(snap, pairs_by_file):
    for rel, pairs in pairs_by_file.items():
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(trl_rows(pairs)), snap / rel)
    (snap / "README.md").write_text(CARD)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """`org/toy-math` cached at two commits, HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing here."""
    repo = tmp_path / "hub" / "datasets--org--toy-math"
    write_snapshot(repo / "snapshots" / MAIN, {
        "main/train-00000-of-00001.parquet": [(f"{i}+{i}", str(2 * i)) for i in range(12)],
        "main/test-00000-of-00001.parquet": [("7+8", "15"), ("9+9", "18")],
        "socratic/train-00000-of-00001.parquet": [("1+2", "3")],
    })
    write_snapshot(repo / "snapshots" / OLD, {
        "main/train-00000-of-00001.parquet": [("40+2", "42")],
        "main/test-00000-of-00001.parquet": [("1+1", "2")],
        "socratic/train-00000-of-00001.parquet": [("1+2", "3")],
    })
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def hf(**over):
    base = {"kind": "hf", "name": "org/toy-math", "config": "main",
            "answer_field": "reward_model.ground_truth"}
    return parse_dataset_config({**base, **over})


def test_hub_id_loads_from_the_cache_offline_with_trl_prompts_and_nested_answers(hub_cache):
    ds = hf(eval_split="test", system_prompt="Answer with a number.").build()
    train, held_out = ds.train_rows(), ds.eval_rows()
    assert len(train) == 12 and [r["answer"] for r in held_out] == ["15", "18"]
    row = held_out[0]
    assert row["messages"] == [{"role": "system", "content": "Answer with a number."},
                               {"role": "user", "content": "What is 7+8?"}]
    assert row["question"] == "What is 7+8?"  # the last user turn, for ids and logs
    # the parent of the nested answer stays as an extra; the consumed prompt column does not
    assert row["reward_model"]["style"] == "rule" and row["data_source"] == "toy"
    assert "prompt" not in row


def test_revision_config_and_fraction_split(hub_cache):
    old = hf(revision=OLD, eval_split="test").build()
    assert [r["answer"] for r in old.train_rows()] == ["42"]
    socratic = hf(config="socratic", eval_fraction=0.0).build()
    assert [r["answer"] for r in socratic.train_rows()] == ["3"] and socratic.eval_rows() == []
    split = hf(eval_fraction=0.5, seed=1).build()  # no eval_split: held out from `split`
    assert len(split.train_rows()) + len(split.eval_rows()) == 12
    assert 0 < len(split.eval_rows()) < 12


def test_errors_name_the_allowed_splits_configs_and_columns(hub_cache):
    with pytest.raises(DatasetError, match=r"split='validation' not found; allowed: train, test"):
        hf(split="validation").build()
    with pytest.raises(DatasetError, match=r"eval_split='dev' not found; allowed: train, test"):
        hf(eval_split="dev").build()
    with pytest.raises(DatasetError, match=r"config='nope' is not a subset .* allowed: main, "
                                           r"socratic"):
        hf(config="nope").build()
    with pytest.raises(DatasetError, match=r"several subsets; set data.config .* main, socratic"):
        hf(config=None).build()
    with pytest.raises(DatasetError, match=r"missing field 'reward_model.answer' \(have: "
                                           r"reward_model.ground_truth, reward_model.style\)"):
        hf(answer_field="reward_model.answer").build()
    with pytest.raises(DatasetError, match=r"missing field 'solution' \(have: prompt, "
                                           r"reward_model, data_source\)"):
        hf(answer_field="solution").build()


def test_a_hub_id_not_in_the_cache_is_one_line_naming_id_cache_and_fix(hub_cache):
    with pytest.raises(DatasetError) as err:
        hf(name="org/never-downloaded").build()
    msg = str(err.value)
    assert "\n" not in msg
    assert "data.name=org/never-downloaded" in msg and str(hub_cache) in msg
    assert "HF_HUB_OFFLINE" in msg and "download it once" in msg


def test_offline_from_the_start_a_miss_fails_fast_without_the_network(tmp_path, monkeypatch):
    """A real job has HF_HUB_OFFLINE set before `datasets` is imported (here: its import-time
    flag set): then `datasets` is asked for its own cache too, and its ConnectionError on a
    miss still becomes the one-line error about the HF cache, at once (offline it never
    touches the network)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    start = time.monotonic()
    with pytest.raises(DatasetError, match=r"^data.name=org/gone: dataset not found in the HF "
                                           r"cache .* and offline \(HF_HUB_OFFLINE\)"):
        parse_dataset_config({"kind": "hf", "name": "org/gone"}).build()
    assert time.monotonic() - start < 5


def test_a_local_directory_of_parquet_splits(tmp_path, monkeypatch):
    data = tmp_path / "mydata" / "data"
    data.mkdir(parents=True)
    train = {"problem": ["2+3", "4+4"], "meta": [{"answer": "5"}, {"answer": "8"}]}
    pq.write_table(pa.table(train), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"problem": ["1+6"], "meta": [{"answer": "7"}]}),
                   data / "test-00000-of-00001.parquet")
    ds = parse_dataset_config({
        "kind": "hf", "name": str(tmp_path / "mydata"), "eval_split": "test",
        "question_field": "problem", "answer_field": "meta.answer",
        "prompt_template": "Compute {question}."}).build()
    assert [(r["question"], r["answer"]) for r in ds.train_rows()] == [("2+3", "5"), ("4+4", "8")]
    assert ds.eval_rows()[0]["messages"] == [{"role": "user", "content": "Compute 1+6."}]
    monkeypatch.chdir(tmp_path)  # `mydata` could be a hub id by its shape, but it exists here
    with pytest.raises(DatasetError, match="revision='v1' applies to hub ids"):
        parse_dataset_config({"kind": "hf", "name": "mydata", "revision": "v1"}).build()
    with pytest.raises(DatasetError, match=r"data.name=\./nowhere: not found"):
        parse_dataset_config({"kind": "hf", "name": "./nowhere"}).build()


def test_a_single_local_jsonl_file_by_name(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}*2", "answer": 2 * i}) + "\n"
                            for i in range(4)))
    ds = parse_dataset_config({"kind": "hf", "name": str(path), "eval_fraction": 0.0}).build()
    assert [r["answer"] for r in ds.train_rows()] == ["0", "2", "4", "6"]


def test_jsonl_kind_keeps_a_rows_messages_and_prepends_the_system_prompt(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"},
        {"messages": [{"role": "system", "content": "Own system."},
                      {"role": "user", "content": "3+3?"}], "answer": "6"},
        {"question": "5+5", "answer": "10"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = parse_dataset_config({"kind": "jsonl", "path": str(path), "eval_fraction": 0.0,
                               "system_prompt": "Be brief."}).build()
    got = [r["messages"] for r in ds.train_rows()]
    assert got[0] == [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "2+2?"}]
    assert got[1][0] == {"role": "system", "content": "Own system."} and len(got[1]) == 2
    assert got[2] == [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "5+5"}]


def test_parquet_kind_takes_nested_question_and_answer_paths(tmp_path):
    path = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"extra_info": [{"question": "6*7", "index": 0}],
                             "reward_model": [{"ground_truth": "42"}]}), path)
    ds = parse_dataset_config({"kind": "parquet", "path": str(path), "eval_fraction": 0.0,
                               "question_field": "extra_info.question",
                               "answer_field": "reward_model.ground_truth"}).build()
    (row,) = ds.train_rows()
    assert (row["question"], row["answer"]) == ("6*7", "42")
    assert row["messages"] == [{"role": "user", "content": "6*7"}]


def test_record_mapping_edge_cases():
    fields = RecordFields()
    # TRL's standard format: a string prompt is the question text
    row = to_row({"prompt": "1+1", "answer": "2"}, fields, "r")
    assert row["question"] == "1+1" and row["messages"] == [{"role": "user", "content": "1+1"}]
    # a key containing the dot itself wins over the nested path
    dotted = to_row({"question": "q", "a.b": "lit", "a": {"b": "nested"}},
                    RecordFields(answer_field="a.b"), "r")
    assert dotted["answer"] == "lit"
    with pytest.raises(DatasetError, match=r"field 'prompt' must be a non-empty list of messages"):
        to_row({"prompt": [{"content": "no role"}], "answer": "1"}, fields, "r")
    with pytest.raises(DatasetError, match=r"r: missing field 'question' \(have: answer\)"):
        to_row({"answer": "1"}, fields, "r")
    with pytest.raises(ConfigError, match="prompt_template"):
        parse_dataset_config({"kind": "hf", "name": "org/x", "prompt_template": "no slot"})
    with pytest.raises(ConfigError, match="revision='v1' applies to a hub id"):
        parse_dataset_config({"kind": "hf", "name": "./local", "revision": "v1"})
    with pytest.raises(ConfigError, match="did you mean"):
        parse_dataset_config({"kind": "hf", "name": "org/x", "eval_splt": "test"})
