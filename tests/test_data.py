"""Datasets: arithmetic generation, GSM8K and generic file loaders, the split, config dispatch."""

import json
import math
import random
import re
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pydantic
import pytest

from asyncrl.config import Config, ConfigError
from asyncrl.data import (ArithmeticTaskConfig, DatasetConfig, DatasetError, FileDatasetConfig,
                          GSM8KConfig, deterministic_split, parse_dataset_config)
from asyncrl.data.arithmetic import ArithmeticTask
from asyncrl.data.dataset import DATASETS


def load_dataset(data):
    return parse_dataset_config(data).build()
from asyncrl.reward import exact_answer_reward


def independent_value(expr: str) -> int:
    """Evaluate "a+b*c-d" without the generator's code: split into signed products."""
    total = 0
    for sign, term in re.findall(r"([+-]?)(\d+(?:\*\d+)*)", expr):
        total += (-1 if sign == "-" else 1) * math.prod(int(x) for x in term.split("*"))
    return total


def check_row_shape(row):
    assert isinstance(row["id"], str) and row["id"]
    assert isinstance(row["question"], str) and isinstance(row["answer"], str)
    assert row["messages"][0]["role"] == "user" and len(row["messages"]) == 1


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_defaults_short_prompt_and_ids():
    task = ArithmeticTaskConfig(num_train=50, num_eval=10).build()
    row = task.train_rows()[0]
    check_row_shape(row)
    assert re.fullmatch(r"\d{1,2}\+\d{1,2}", row["question"])
    assert row["messages"][0]["content"] == row["question"] + "="
    assert re.fullmatch(r"arith-[0-9a-f]{12}", row["id"])
    assert len(task.train_rows()) == 50 and len(task.eval_rows()) == 10


def test_arithmetic_default_config_fits_its_problem_space():
    task = ArithmeticTaskConfig().build()  # 10,000 two-digit sums; defaults must not overflow them
    assert len(task.train_rows()) == 9000 and len(task.eval_rows()) == 500


def test_arithmetic_deterministic_per_seed():
    cfg = dict(digits=3, num_operands=3, operators=["+", "-", "*"], num_train=200, num_eval=50)
    a = ArithmeticTaskConfig(**cfg, seed=1).build()
    b = ArithmeticTaskConfig(**cfg, seed=1).build()
    c = ArithmeticTaskConfig(**cfg, seed=2).build()
    assert a.train_rows() == b.train_rows() and a.eval_rows() == b.eval_rows()
    assert [r["id"] for r in a.train_rows()] != [r["id"] for r in c.train_rows()]


def test_arithmetic_pinned_output():
    # Pins cross-process reproducibility (seeded random.Random, sha1 ids), which an in-process
    # "same seed twice" comparison cannot see.
    task = ArithmeticTaskConfig(num_train=3, num_eval=2).build()
    assert [r["question"] for r in task.eval_rows()] == ["97+70", "36+31"]
    assert [r["question"] for r in task.train_rows()] == ["70+59", "4+21", "98+78"]
    assert task.eval_rows()[0]["id"] == "arith-805fdc970232"


def test_arithmetic_eval_set_stable_when_num_train_changes():
    small = ArithmeticTaskConfig(digits=3, num_train=10, num_eval=30).build()
    large = ArithmeticTaskConfig(digits=3, num_train=500, num_eval=30).build()
    assert small.eval_rows() == large.eval_rows()


@pytest.mark.parametrize("cfg", [
    dict(digits=1, num_operands=2, operators=["-"], num_train=30, num_eval=10),  # enumerated
    dict(digits=2, num_operands=3, operators=["+", "-", "*"]),  # sampled
    dict(digits=1, num_operands=4, operators=["-", "*"], num_train=500),
    dict(digits=2, num_operands=4, operators=["-", "*"], allow_negative=True, num_train=500),
    dict(digits=6, num_operands=2, operators=["*"], num_train=300),
])
def test_arithmetic_answers_correct_and_splits_disjoint(cfg):
    task = ArithmeticTaskConfig(**cfg).build()
    train, held_out = task.train_rows(), task.eval_rows()
    exprs = [r["question"] for r in train + held_out]
    assert len(set(exprs)) == len(exprs), "duplicate problems"
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    assert len({r["id"] for r in train + held_out}) == len(exprs)
    negatives = 0
    for row in train + held_out:
        check_row_shape(row)
        value = independent_value(row["question"])
        assert row["answer"] == str(value), row
        assert exact_answer_reward(row["answer"], row["answer"]) == 1.0
        assert exact_answer_reward(str(value + 1), row["answer"]) == 0.0
        negatives += value < 0
        operands = re.findall(r"\d+", row["question"])
        assert len(operands) == task.cfg.num_operands
        assert all(len(x) <= task.cfg.digits for x in operands)
        assert set(re.findall(r"[-+*]", row["question"])) <= set(task.cfg.operators)
    if not task.cfg.allow_negative:
        assert negatives == 0
    elif "-" in task.cfg.operators:
        assert negatives > 0  # the flag must actually let negatives through


def test_arithmetic_rejects_negative_running_result():
    task = ArithmeticTaskConfig(digits=1, num_operands=3, operators=["-", "+"], num_train=100,
                                num_eval=0).build()
    for row in task.train_rows():
        running = 0
        for sign, term in re.findall(r"([+-]?)(\d+)", row["question"]):
            running += -int(term) if sign == "-" else int(term)
            assert running >= 0, row["question"]


def test_arithmetic_custom_prompt_template():
    task = ArithmeticTaskConfig(prompt_template="Q: {expr} A:", num_train=5, num_eval=1).build()
    row = task.train_rows()[0]
    assert row["messages"][0]["content"] == f"Q: {row['question']} A:"


@pytest.mark.parametrize("data, needle", [
    ({"digits": 0}, "digits=0"),
    ({"digits": 7}, "digits=7"),
    ({"num_operands": 5}, "num_operands=5"),
    ({"operators": []}, "operators=[]"),
    ({"operators": ["/"]}, "operators.0='/'"),
    ({"operators": ["+", "+"]}, "each operator at most once"),
    ({"prompt_template": "compute {x}="}, "prompt_template='compute {x}=' must contain '{expr}'"),
    ({"digit": 3}, "unknown key 'digit'; did you mean 'digits'?"),
])
def test_arithmetic_config_validation(data, needle):
    with pytest.raises(ConfigError) as err:
        ArithmeticTaskConfig.from_dict(data, "task.yaml")
    assert needle in str(err.value)
    assert str(err.value).startswith("task.yaml: ")


def test_arithmetic_space_too_small():
    cfg = ArithmeticTaskConfig(digits=1, num_operands=2, operators=["+"], num_train=95, num_eval=10)
    with pytest.raises(ValueError) as err:
        cfg.build()
    msg = str(err.value)
    assert "digits=1" in msg and "num_operands=2" in msg and "only 100 distinct" in msg
    assert "105" in msg
    # Subtraction without negatives: only a >= b, 55 of the 100 pairs.
    with pytest.raises(ValueError, match="only 55 distinct"):
        ArithmeticTaskConfig(digits=1, operators=["-"], num_train=50, num_eval=10).build()
    assert len(ArithmeticTaskConfig(digits=1, operators=["-"], num_train=45, num_eval=10)
               .build().train_rows()) == 45


def test_arithmetic_sampled_space_exhaustion_is_reported(monkeypatch):
    # Force the sampling path on a tiny space so the draw budget, not enumeration, must catch it.
    monkeypatch.setattr("asyncrl.data.arithmetic.ENUMERATE_LIMIT", 0)
    with pytest.raises(ValueError, match=r"digits=1, num_operands=2.*only 100 distinct"):
        ArithmeticTask(ArithmeticTaskConfig(digits=1, num_train=200, num_eval=0))


# ---------------------------------------------------------------- GSM8K


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GSM_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,200 eggs a day for 10 days.",
     "answer": "1200*10=12000\n#### 12,000"},
    {"question": "Temperature drops 5 below 0.", "answer": "It is -5.\n####  -5 "},
]


def test_gsm8k_parses_answers_and_solutions(tmp_path):
    path = write_lines(tmp_path / "gsm.jsonl", [json.dumps(r) for r in GSM_ROWS] + [""])
    ds = GSM8KConfig(path=path, eval_fraction=0.0).build()
    rows = ds.train_rows()
    assert ds.eval_rows() == []
    assert [r["answer"] for r in rows] == ["7", "12000", "-5"]
    assert rows[0]["solution"] == "3 + 4 = <<3+4=7>>7"
    assert rows[0]["messages"][0]["content"] == (
        "Tom has 3 apples and buys 4. How many?\nPut the final answer after ####.")
    assert all(re.fullmatch(r"gsm8k-[0-9a-f]{12}", r["id"]) for r in rows)
    assert exact_answer_reward("1200 times 10 is 12,000.\n#### 12,000", rows[1]["answer"]) == 1.0


def test_gsm8k_separate_eval_file_and_duplicate_questions(tmp_path):
    train = write_lines(tmp_path / "train.jsonl", [json.dumps(GSM_ROWS[0])] * 2)
    held_out = write_lines(tmp_path / "test.jsonl", [json.dumps(GSM_ROWS[1])])
    ds = GSM8KConfig(path=train, eval_path=held_out).build()
    ids = [r["id"] for r in ds.train_rows()]
    assert len(ids) == 2 and len(set(ids)) == 2 and ids[1] == ids[0] + "-2"
    assert [r["answer"] for r in ds.eval_rows()] == ["12000"]


@pytest.mark.parametrize("bad_line, expected", [
    ('{"question": "q", "foo": 1}', "bad.jsonl:3: missing field 'answer' (have: question, foo)"),
    ('{"answer": "#### 4"}', "bad.jsonl:3: missing field 'question' (have: answer)"),
    ('{"question": "q", "answer": "it is 4"}',
     "bad.jsonl:3: field 'answer' has no '#### <final answer>' marker: 'it is 4'"),
    ('{"question": "q", "answer": "####  "}', "bad.jsonl:3: field 'answer' is empty after '####'"),
    ('{"question": "q", "answer": 4}', "bad.jsonl:3: field 'answer' must be a string, got int"),
    ('{"question": "q", "answer": ', "bad.jsonl:3: malformed JSON: Expecting value (column 29)"),
    ('["q", "a"]', "bad.jsonl:3: expected a JSON object, got list"),
])
def test_gsm8k_error_lines(tmp_path, bad_line, expected):
    # Line 2 is blank: line numbers must count physical lines, not parsed rows.
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(GSM_ROWS[0]), "", bad_line])
    with pytest.raises(DatasetError) as err:
        GSM8KConfig(path=path).build()
    msg = str(err.value)
    assert msg == f"{tmp_path}/{expected}"
    assert "\n" not in msg
    assert isinstance(err.value, ValueError)


def test_gsm8k_missing_file_and_non_utf8(tmp_path):
    with pytest.raises(DatasetError, match="nope.jsonl: dataset file not found"):
        GSM8KConfig(path=str(tmp_path / "nope.jsonl")).build()
    bad = tmp_path / "latin.jsonl"
    bad.write_bytes(json.dumps(GSM_ROWS[0]).encode() + b'\n{"question": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match=r"latin.jsonl:2: not UTF-8"):
        GSM8KConfig(path=str(bad)).build()


# ---------------------------------------------------------------- generic files

CUSTOM = {
    "uid": ["a1", "a2", "a3"],
    "problem": ["What is 6*7?", "Capital of France?", "Sum of 500 and 700?"],
    "target": ["42", "Paris", "1,200"],
    "level": [1, 2, 1],
}


def custom_records():
    return [dict(zip(CUSTOM, values)) for values in zip(*CUSTOM.values())]


def check_custom(ds):
    rows = ds.train_rows()
    assert ds.eval_rows() == []
    assert [r["id"] for r in rows] == ["a1", "a2", "a3"]
    assert [r["answer"] for r in rows] == ["42", "Paris", "1200"]
    assert rows[0]["question"] == "What is 6*7?"
    assert rows[0]["messages"] == [{"role": "user", "content": "Problem: What is 6*7?"}]
    assert rows[0]["level"] == 1  # unmapped columns pass through
    assert "uid" not in rows[0] and "problem" not in rows[0]


def file_cfg(kind, path, **kw):
    return dict(kind=kind, path=str(path), question_field="problem", answer_field="target",
                id_field="uid", prompt_template="Problem: {question}", eval_fraction=0.0) | kw


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_jsonl_with_custom_fields(tmp_path, no_network):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in custom_records()])
    check_custom(load_dataset(file_cfg("jsonl", path)))


def test_parquet_with_custom_fields(tmp_path, no_network):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table(CUSTOM), path)
    check_custom(load_dataset(file_cfg("parquet", path)))


def test_parquet_gsm8k_style_answers_and_hashed_ids(tmp_path):
    path = tmp_path / "gsm.parquet"
    pq.write_table(pa.table({k: [r[k] for r in GSM_ROWS] for k in ("question", "answer")}), path)
    ds = FileDatasetConfig(kind="parquet", path=str(path), eval_fraction=0.0).build()
    rows = ds.train_rows()
    assert [r["answer"] for r in rows] == ["7", "12000", "-5"]
    assert rows[1]["solution"] == "1200*10=12000"
    assert rows[0]["messages"][0]["content"] == GSM_ROWS[0]["question"]
    assert all(re.fullmatch(r"q-[0-9a-f]{12}", r["id"]) for r in rows)


def test_file_missing_field_errors(tmp_path):
    records = custom_records()
    del records[2]["target"]
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in records])
    with pytest.raises(DatasetError) as err:
        load_dataset(file_cfg("jsonl", path))
    assert str(err.value) == f"{path}: row 2: missing field 'target' (have: uid, problem, level)"

    pq_path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["q"], "answer": ["1"]}), pq_path)
    with pytest.raises(DatasetError) as err:
        load_dataset(file_cfg("parquet", pq_path))
    assert str(err.value) == f"{pq_path}: row 0: missing field 'problem' (have: question, answer)"


def test_file_unreadable_and_duplicate_ids(tmp_path):
    bad = write_lines(tmp_path / "bad.jsonl", ['{"question": "q", "answer": "1"}', "{oops"])
    with pytest.raises(DatasetError, match=r"bad.jsonl: cannot read as jsonl: ") as err:
        FileDatasetConfig(kind="jsonl", path=bad).build()
    assert "\n" not in str(err.value)
    with pytest.raises(DatasetError, match="missing.parquet: dataset file not found"):
        FileDatasetConfig(kind="parquet", path=str(tmp_path / "missing.parquet")).build()
    dup = write_lines(tmp_path / "dup.jsonl", ['{"k": 1, "question": "a", "answer": "1"}',
                                               '{"k": 1, "question": "b", "answer": "2"}'])
    with pytest.raises(DatasetError, match=r"dup.jsonl: row 1: duplicate k='1' \(first seen"):
        FileDatasetConfig(kind="jsonl", path=dup, id_field="k").build()


# ---------------------------------------------------------------- split


def make_rows(n):
    return [{"id": f"row-{i}", "question": f"q{i}", "answer": str(i)} for i in range(n)]


def test_split_stable_under_shuffle_and_growth():
    rows = make_rows(1000)
    train, held_out = deterministic_split(rows, 0.2, seed=3)
    assert 150 <= len(held_out) <= 250
    assert len(train) + len(held_out) == 1000
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    _, held_out2 = deterministic_split(shuffled, 0.2, seed=3)
    assert {r["id"] for r in held_out2} == {r["id"] for r in held_out}
    # Adding rows never moves an existing one across the boundary.
    _, held_out3 = deterministic_split(rows + make_rows(1500)[1000:], 0.2, seed=3)
    assert {r["id"] for r in held_out3} >= {r["id"] for r in held_out}
    _, other_seed = deterministic_split(rows, 0.2, seed=4)
    assert {r["id"] for r in other_seed} != {r["id"] for r in held_out}


def test_split_pinned_hash():
    # sha256 of (seed, id), not Python's per-process salted hash(): the same rows in every run.
    rows = [{"id": f"row-{i}"} for i in range(20)]
    held_out = [r["id"] for r in deterministic_split(rows, 0.3, seed=0)[1]]
    assert held_out == ["row-0", "row-1", "row-2", "row-3", "row-6", "row-8", "row-14", "row-16"]


def test_split_edges_and_rows_without_ids():
    rows = [{"question": f"what is {i}?", "answer": str(i)} for i in range(100)]
    train, held_out = deterministic_split(rows, 0.5, seed=0)
    assert all(r["id"].startswith("q-") for r in train + held_out)
    again, _ = deterministic_split(list(reversed(rows)), 0.5, seed=0)
    assert {r["id"] for r in again} == {r["id"] for r in train}
    assert deterministic_split(rows, 0.0)[1] == [] and deterministic_split(rows, 1.0)[0] == []
    with pytest.raises(ValueError, match=r"eval_fraction=1.5: must be in \[0, 1\]"):
        deterministic_split(rows, 1.5)
    with pytest.raises(DatasetError, match="row 0: has neither an 'id' nor a string 'question'"):
        deterministic_split([{"answer": "1"}], 0.5)


def test_file_dataset_split_fraction(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"question": f"q{i}", "answer": str(i)})
                                              for i in range(400)])
    ds = FileDatasetConfig(kind="jsonl", path=path, eval_fraction=0.25, seed=1).build()
    assert 60 <= len(ds.eval_rows()) <= 140
    assert not {r["id"] for r in ds.train_rows()} & {r["id"] for r in ds.eval_rows()}


# ---------------------------------------------------------------- dispatch on kind


class RunCfg(Config):
    data: DatasetConfig = pydantic.Field(default_factory=ArithmeticTaskConfig)


def test_union_picks_config_class_from_kind(tmp_path):
    path = write_lines(tmp_path / "g.jsonl", [json.dumps(r) for r in GSM_ROWS])
    assert isinstance(RunCfg().data, ArithmeticTaskConfig)
    cases = {"arithmetic": ArithmeticTaskConfig, "gsm8k": GSM8KConfig,
             "jsonl": FileDatasetConfig, "parquet": FileDatasetConfig}
    for kind, cls in cases.items():
        cfg = RunCfg.from_dict({"data": {"kind": kind, "path": path}} if kind != "arithmetic"
                               else {"data": {"kind": kind, "digits": 1, "num_train": 5}})
        assert type(cfg.data) is cls and cfg.data.kind == kind
        assert RunCfg.from_dict(cfg.to_dict()) == cfg  # YAML round trip keeps the kind
    ds = load_dataset({"kind": "gsm8k", "path": path, "eval_fraction": 0.0})
    assert [r["answer"] for r in ds.train_rows()] == ["7", "12000", "-5"]
    run = RunCfg.from_dict({"data": {"kind": "jsonl", "path": path, "eval_fraction": 0}})
    ds = run.data.build()
    assert ds.train_rows()[0]["solution"] == "3 + 4 = <<3+4=7>>7"


def test_union_rejects_unknown_kind():
    with pytest.raises(ConfigError) as err:
        RunCfg.from_dict({"data": {"kind": "foo", "path": "x"}}, "run.yaml")
    msg = str(err.value)
    assert msg.startswith("run.yaml: data")
    assert msg.endswith("allowed: arithmetic, arithmetic_submit, chain, counting, gsm8k, jsonl, "
                        "parquet, hf")
    with pytest.raises(ConfigError) as err:
        parse_dataset_config({"kind": "foo"}, "run.yaml: data")
    assert str(err.value) == ("run.yaml: data: dataset kind='foo' is not known; "
                              "allowed: arithmetic, arithmetic_submit, chain, counting, gsm8k, "
                              "jsonl, parquet, hf")
    with pytest.raises(ConfigError, match="kind=3 is not known"):
        load_dataset({"kind": 3})
    with pytest.raises(ConfigError, match="data: dataset=3: expected a name or a mapping"):
        RunCfg.from_dict({"data": 3})


def test_missing_kind_means_the_default_arithmetic_task():
    # `asyncrl sft data.num_train=200` overrides fields of the default without naming the kind.
    cfg = RunCfg.load(None, ["data.num_train=20", "data.digits=1"])
    assert isinstance(cfg.data, ArithmeticTaskConfig) and cfg.data.num_train == 20
    assert len(load_dataset({"num_train": 7, "num_eval": 2}).train_rows()) == 7
    assert DATASETS.kinds() == ["arithmetic", "arithmetic_submit", "chain", "counting", "gsm8k",
                                "jsonl", "parquet", "hf"]
    where = {"arithmetic": {}, "arithmetic_submit": {}, "chain": {}, "counting": {},
             "hf": {"name": "org/p"}}
    for kind in DATASETS.kinds():  # each name validates into its registered class
        cls = DATASETS.config_class(kind)
        member = RunCfg.from_dict({"data": {"kind": kind, **where.get(kind, {"path": "p"})}}).data
        assert type(member) is cls


def test_parse_dataset_config_member_errors():
    with pytest.raises(ConfigError, match="unknown key 'pth'; did you mean 'path'"):
        parse_dataset_config({"kind": "gsm8k", "pth": "x"})
    with pytest.raises(ConfigError, match="missing required key 'path'"):
        parse_dataset_config({"kind": "parquet"})
    with pytest.raises(ConfigError, match="eval_fraction=2"):
        parse_dataset_config({"kind": "jsonl", "path": "x", "eval_fraction": 2})
    with pytest.raises(ConfigError, match="must contain '{question}'"):
        parse_dataset_config({"kind": "gsm8k", "path": "x", "prompt_template": "{q}"})
