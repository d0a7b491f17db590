"""The built-in `dots` task: each row's image shows as many dots as its answer says (counted
back from the pixels), rows are the same on every access, the splits share no layout, the reward
takes exactly the count, and `grouprl sft` fits a fresh tiny vision-language model to it that
`grouprl train` then trains."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from grouprl.cli import main
from grouprl.errors import UserError
from grouprl.tasks import get_task
from grouprl.tasks.builtin.dots import correct


def blobs(image) -> int:
    """Dark 4-connected regions of an image (its dots), by flood fill."""
    dark = np.asarray(image.convert("L")) < 128
    seen = np.zeros_like(dark)
    count = 0
    for start in zip(*np.nonzero(dark), strict=True):
        if seen[start]:
            continue
        count += 1
        stack = [start]
        while stack:
            y, x = stack.pop()
            if 0 <= y < dark.shape[0] and 0 <= x < dark.shape[1] and dark[y, x] and not seen[y, x]:
                seen[y, x] = True
                stack += [(y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)]
    return count


def test_each_image_shows_its_answers_count_and_rows_repeat():
    task = get_task("dots", train_size=40, heldout_size=20)
    for split in (task.train, task.heldout):
        for row in split:
            assert row["image"].size == (64, 64) and row["image"].mode == "RGB"
            assert blobs(row["image"]) == int(row["answer"]) and 1 <= int(row["answer"]) <= 4
    again = get_task("dots", train_size=40, heldout_size=20)
    assert [r["answer"] for r in task.train] == [r["answer"] for r in again.train]
    assert np.array_equal(np.asarray(task.train[7]["image"]), np.asarray(again.train[7]["image"]))


def test_the_splits_share_no_layout():
    task = get_task("dots", train_size=300, heldout_size=100)
    train = {task.train.layout(i).key() for i in range(len(task.train))}
    heldout = {task.heldout.layout(i).key() for i in range(len(task.heldout))}
    assert not train & heldout


def test_the_reward_takes_exactly_the_count():
    assert correct(["3", " 3 ", "33", "three", "2"], answer=["3"] * 5) == [1, 1, 0, 0, 0]
    with pytest.raises(UserError, match="max_dots must be 1 to 6"):
        get_task("dots", max_dots=9)


def test_sft_fits_a_tiny_vlm_that_train_then_trains(tmp_path):
    base = tmp_path / "base"
    assert main(["sft", "--task", "dots", "--steps", "3", "--batch-size", "4", "--threads", "1",
                 "--output-dir", str(base), "--no-progress"]) == 0  # fmt: skip
    assert {"processor_config.json", "chat_template.jinja"} <= {p.name for p in base.iterdir()}
    run = tmp_path / "run"
    assert main(["train", "--task", "dots", "--model", str(base), "--steps", "2",
                 "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0",
                 "--eval-size", "4", "--eval-samples", "1", "--threads", "1", "--no-progress",
                 "--output-dir", str(run)]) == 0  # fmt: skip
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]


def test_an_image_column_of_another_name_is_warned_about():
    """Images under another column name show no prompt anything: a warning names the column."""
    import io

    from datasets import Dataset, Image
    from PIL import Image as Pil

    from grouprl.tasks.data import RowFormat, check_schema

    buffer = io.BytesIO()
    Pil.new("RGB", (8, 8), "white").save(buffer, format="PNG")
    table = Dataset.from_dict({"picture": [{"bytes": buffer.getvalue(), "path": None}],
                               "prompt": ["How many dots?"]}).cast_column("picture", Image())  # fmt: skip
    with pytest.warns(UserWarning, match="column 'picture' holds images, but no prompt shows"):
        check_schema(table, RowFormat(), "pics")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_schema(table.rename_column("picture", "image"), RowFormat(), "pics")
