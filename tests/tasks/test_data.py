"""Dataset tasks: file formats, column mapping, templates, chat prompts, the hash held-out split,
and one clear line for each kind of bad data."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from grouprl.errors import UserError
from grouprl.tasks.data import (
    MAX_HELDOUT,
    MIN_HELDOUT,
    RowFormat,
    dataset_task,
    heldout_count,
    load_table,
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sums(n):
    return [{"question": f"{i}+{i % 7}", "solution": str(i + i % 7)} for i in range(n)]


@pytest.fixture
def gsm(tmp_path):
    return write_jsonl(tmp_path / "gsm.jsonl", sums(100))


def test_jsonl_with_other_column_names_and_a_template(gsm):
    fmt = RowFormat(prompt_template="Q: {question}\nA:", answer_column="solution")
    task = dataset_task(str(gsm), fmt)
    row = task.train[0]
    assert row["prompt"] == f"Q: {row['question']}\nA:"
    assert row["answer"] == row["solution"]  # as `answer` and under its own name
    assert len(task.train) + len(task.heldout) == 100


@pytest.mark.parametrize("kind", ["csv", "parquet", "save_to_disk", "json"])
def test_other_formats_give_the_same_rows(tmp_path, gsm, kind):
    import datasets

    table = datasets.load_dataset("json", data_files=str(gsm), split="train")
    path = tmp_path / f"data.{kind}"
    if kind == "csv":
        table.to_csv(str(path))
    elif kind == "parquet":
        table.to_parquet(str(path))
    elif kind == "json":
        path.write_text(json.dumps(sums(100)))
    else:
        table.save_to_disk(str(path))
    fmt = RowFormat(prompt_column="question", answer_column="solution")
    a, b = dataset_task(str(gsm), fmt), dataset_task(str(path), fmt)
    assert [r["prompt"] for r in a.heldout] == [r["prompt"] for r in b.heldout]
    assert str(a.train[3]["answer"]) == str(b.train[3]["answer"])


def test_verl_parquet_layout_with_a_nested_answer(tmp_path):
    rows = [
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(80)
    ]
    import datasets

    path = tmp_path / "verl.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    task = dataset_task(str(path), RowFormat(answer_column="reward_model.ground_truth"))
    row = task.train[0]
    assert row["prompt"] == rows[row["extra_info"]["index"]]["prompt"]  # messages kept
    assert row["answer"] == row["reward_model"]["ground_truth"]


def test_chat_template_wraps_strings_and_the_system_prompt_goes_first(gsm, tmp_path):
    fmt = RowFormat(prompt_column="question", chat_template=True, system_prompt="Be brief.")
    row = dataset_task(str(gsm), fmt).train[0]
    assert row["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": row["question"]},
    ]
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": f"q{i}"}]}
         for i in range(70)],
    )  # fmt: skip
    row = dataset_task(str(chat), RowFormat(system_prompt="Be brief.")).train[0]
    assert row["prompt"][0] == {"role": "system", "content": "own"}  # not added twice


def test_heldout_rows_are_fixed_by_the_prompt_hash(tmp_path):
    rows = sums(2000)
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    shuffled = write_jsonl(tmp_path / "b.jsonl", [rows[i] for i in np.random.permutation(2000)])
    fmt = RowFormat(prompt_column="question")
    a, b = dataset_task(str(path), fmt), dataset_task(str(shuffled), fmt)
    held = {r["prompt"] for r in a.heldout}
    assert len(held) == heldout_count(2000, 0.05) == 100
    assert held == {r["prompt"] for r in b.heldout}  # the file order does not matter
    assert held.isdisjoint(r["prompt"] for r in a.train)
    assert len(a.train) == 1900


def test_identical_prompts_stay_on_one_side(tmp_path):
    rows = sums(300) * 2  # every prompt twice
    task = dataset_task(
        str(write_jsonl(tmp_path / "d.jsonl", rows)), RowFormat(prompt_column="question")
    )
    held = [r["prompt"] for r in task.heldout]
    assert len(held) % 2 == 0 and set(held).isdisjoint(r["prompt"] for r in task.train)


@pytest.mark.parametrize(
    ("rows", "fraction", "expected"),
    [(100, 0.05, MIN_HELDOUT), (2000, 0.05, 100), (10**6, 0.05, MAX_HELDOUT), (40, 0.05, 20)],
)
def test_heldout_count_bounds(rows, fraction, expected):
    assert heldout_count(rows, fraction) == expected


def test_a_tiny_dataset_warns_that_it_holds_out_half(tmp_path):
    path = write_jsonl(tmp_path / "tiny.jsonl", sums(10))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = dataset_task(str(path), RowFormat(prompt_column="question"))
    assert len(task.heldout) == 5 and "only 10 rows" in str(caught[0].message)


def test_eval_dataset_replaces_the_hash_split(tmp_path, gsm):
    other = write_jsonl(tmp_path / "test.jsonl", sums(7))
    task = dataset_task(str(gsm), RowFormat(prompt_column="question"), eval_source=str(other))
    assert len(task.train) == 100 and len(task.heldout) == 7


def test_rows_are_read_lazily_from_arrow(gsm):
    task = dataset_task(str(gsm), RowFormat(prompt_column="question"))
    assert isinstance(task.train.indices, np.ndarray)  # an index, not a list of dicts
    assert task.train[-1] == task.train[len(task.train) - 1]


@pytest.mark.parametrize(
    ("setup", "fmt", "message"),
    [
        (lambda p: None, RowFormat(), r"dataset .*missing.jsonl does not exist"),
        (lambda p: p.write_text(""), RowFormat(), r"is empty; give it at least one row"),
        (lambda p: p.write_text('{"prompt": "a"}\n{oops\n'), RowFormat(), r"cannot read dataset"),
        (lambda p: write_jsonl(p, sums(3)), RowFormat(),
         r"no column 'prompt' \(columns: question, solution\); name the column with --prompt-column"),
        (lambda p: write_jsonl(p, sums(3)), RowFormat(prompt_column="question", answer_column="sol"),
         r"no column 'sol' \(columns: question, solution\); name the column with --answer-column"),
        (lambda p: write_jsonl(p, [{"prompt": "a", "r": {"x": 1}}]), RowFormat(answer_column="r.y"),
         r"no column 'r.y' \(fields of 'r': x\)"),
        (lambda p: write_jsonl(p, [{"prompt": 5}]), RowFormat(),
         r"column 'prompt' holds .*int64.*; a prompt must be a string or a list of \{role, content\}"),
        (lambda p: write_jsonl(p, sums(3)), RowFormat(prompt_template="{questoin}="),
         r"--prompt-template names \{questoin\} but dataset .* has no column 'questoin'"),
        (lambda p: write_jsonl(p, sums(3)), RowFormat(prompt_template="{question"),
         r"--prompt-template is not a valid format string"),
        (lambda p: write_jsonl(p, sums(3)), RowFormat(prompt_column="question", system_prompt="x"),
         r"--system-prompt needs chat prompts.*--chat-template"),
        (lambda p: write_jsonl(p, [{"prompt": "a"}, {"prompt": None}] * 40), RowFormat(),
         r"row 1: the prompt is missing"),
        (lambda p: write_jsonl(p, [{"prompt": "a"}, {"prompt": "  "}] * 40), RowFormat(),
         r"row 1: the prompt is empty"),
    ],
)  # fmt: skip
def test_bad_data_is_one_clear_line(tmp_path, setup, fmt, message):
    path = tmp_path / "missing.jsonl"
    setup(path)
    with pytest.raises(UserError, match=message):
        task = dataset_task(str(path), fmt)
        [task.train[i] for i in range(len(task.train))]  # row-level problems show when read


@pytest.mark.filterwarnings("ignore:dataset .* has only")
def test_a_prompt_that_is_not_messages_names_its_row(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}] * 40 + [{"prompt": [{"role": "user"}]}]
    task = dataset_task(str(write_jsonl(tmp_path / "m.jsonl", rows)), RowFormat())
    with pytest.raises(UserError, match=r"row 40: the prompt is neither a string nor a list"):
        [task.train[i] for i in range(len(task.train))] + list(task.heldout)


@pytest.mark.parametrize(
    ("name", "message"),
    [("x.txt", r"unsupported format '.txt'"), ("gsm8k-offline", r"could not be loaded as a hub dataset")],
)  # fmt: skip
def test_unsupported_sources(tmp_path, name, message):
    path = tmp_path / name
    if name.endswith(".txt"):
        path.write_text("hello\n")
        name = str(path)
    with pytest.raises(UserError, match=message):
        load_table(name)


def test_duplicates_at_the_boundary_never_leave_training_empty(tmp_path):
    rows = [{"prompt": "same"}] * 40 + [{"prompt": "other"}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        task = dataset_task(str(write_jsonl(tmp_path / "d.jsonl", rows)), RowFormat())
    assert len(task.train) >= 1 and len(task.heldout) >= 1
    assert {r["prompt"] for r in task.train}.isdisjoint(r["prompt"] for r in task.heldout)
    with pytest.raises(UserError, match=r"every row of dataset .* has the same prompt"):
        dataset_task(str(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "x"}] * 50)), RowFormat())


def test_a_data_file_has_only_the_train_split(gsm, tmp_path):
    with pytest.raises(UserError, match=r"single file, which has no split 'test' \(only train\)"):
        dataset_task(str(gsm), RowFormat(prompt_column="question"), split="test")


def test_messages_of_varying_shape_take_a_system_prompt(tmp_path):
    """datasets stores message lists whose keys differ between rows as free-form JSON; they are
    still chat prompts."""
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(40)]
    rows += [{"prompt": [{"role": "user", "content": "x", "name": "ann"}]}]
    fmt = RowFormat(system_prompt="Be brief.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        task = dataset_task(str(write_jsonl(tmp_path / "v.jsonl", rows)), fmt)
    assert task.train[0]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_a_template_on_a_column_of_the_wrong_type_names_the_row(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"n": i} for i in range(70)])
    with pytest.raises(UserError, match=r"row 0: --prompt-template cannot be filled"):
        dataset_task(str(path), RowFormat(prompt_template="{n[0]}"))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("rows.jsonl", '{"prompt": "1+1="}\n{"prompt": \n{"prompt": "3+3="}\n',
         "line 2 is not valid JSON (Expecting value, column 12)"),
        ("rows.jsonl", '{"prompt": "1+1="}\n["a list"]\n', "line 2 is not a JSON object"),
        ("rows.json", '[{"prompt": "1+1="},\n', "not valid JSON at line 2, column 1"),
        ("rows.csv", "prompt,answer\n1+1=,2\n2+2=,4,extra\n",
         "line 3 has 3 fields where the header has 2"),
        ("rows.parquet", "not parquet at all\n", "not a Parquet file"),
    ],
)  # fmt: skip
def test_a_malformed_data_file_is_one_line_naming_the_line(tmp_path, capfd, name, content, message):
    from grouprl.tasks.data import load_table

    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UserError) as raised:
        load_table(str(path))
    assert str(raised.value).startswith(f"cannot read dataset {path}: {message}")
    assert "\n" not in str(raised.value)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""  # datasets' own log line is not shown
