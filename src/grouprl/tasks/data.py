"""Tasks from dataset files: TRL's dataset conventions over `datasets`' Arrow tables.

A row's prompt comes from `prompt_column` (nested fields with a dot, `extra_info.question`), or
from `prompt_template` formatted with the row's columns (`"Question: {question}\\nAnswer:"`). It
is either a string, used as it is, or a list of `{"role", "content"}` messages (conversational),
which the sampler renders with the tokenizer's chat template. `chat_template=True` turns string
prompts into one user message; `system_prompt` is put before the messages of every prompt
that has no system message. The reference answer (`answer_column`, e.g.
`reward_model.ground_truth` in verl's Parquet layout) reaches reward functions as `answer` and
under its own column; every other column under its own name.

Rows stay in the Arrow table: a `Rows` view formats one row when it is read, so a large file
costs its index and nothing else. Columns and their types are checked on the schema up front.

Without a separate evaluation dataset, the held-out rows are chosen by a hash of the prompt:
the same rows for any seed, never overlapping training (identical prompts fall on the same
side), and a fixed number of them: `eval_fraction` of the rows, at least 32 and at most 500.
"""

from __future__ import annotations

import hashlib
import json
import string
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grouprl.errors import UserError, one_line
from grouprl.images import IMAGE_COLUMNS, image_digest, warn_unread_image_columns
from grouprl.tasks.base import Task
from grouprl.tasks.live import is_live, live_object

#: Data file formats by suffix, as `datasets.load_dataset` names their builders.
FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
#: Bounds on the number of held-out rows taken from the training dataset.
MIN_HELDOUT, MAX_HELDOUT = 32, 500
#: A generation budget for dataset tasks (a task of our own knows its own).
DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class RowFormat:
    """How a dataset row becomes a task row (see the module docstring)."""

    prompt_column: str = "prompt"
    answer_column: str | None = None
    prompt_template: str | None = None
    chat_template: bool = False
    system_prompt: str | None = None


# ---------------------------------------------------------------------------------------------
# Loading


def _datasets():
    """`datasets`, imported on first use, with its progress bars and info logs off."""
    import datasets

    datasets.disable_progress_bars()
    # its error lines too: a file it cannot parse is reported in one line by `load_table`
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    return datasets


def _unreadable(source: str, path: Path, err: Exception) -> str:
    """One line for a data file datasets could not parse: where (line or row) and what."""
    problem = _file_problem(path) if path.is_file() else None
    return f"cannot read dataset {source}: {problem or one_line(err)}"


def _file_problem(path: Path) -> str | None:
    """The first thing wrong in a JSON, JSONL, CSV or Parquet file, found by reading it plainly
    (datasets' own errors name a byte position, or nothing)."""
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if suffix == ".json":
            try:
                json.loads(text)
                return None
            except ValueError as whole:
                if text.lstrip().startswith("["):  # one JSON document, not JSON Lines
                    return (
                        f"not valid JSON at line {whole.lineno}, column {whole.colno}: {whole.msg}"
                    )
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as bad:
                return f"line {number} is not valid JSON ({bad.msg}, column {bad.colno})"
            if not isinstance(value, dict):
                return f'line {number} is not a JSON object ({{"prompt": ...}}) but {type(value).__name__}'
        return None
    if suffix == ".csv":
        import csv

        with path.open(newline="", encoding="utf-8", errors="replace") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            for row in reader:
                if row and len(row) != len(header):
                    return (
                        f"line {reader.line_num} has {len(row)} fields where the header has "
                        f"{len(header)} (quote fields that hold commas)"
                    )
        return None
    if suffix == ".parquet":
        with path.open("rb") as f:
            head = f.read(4)
            f.seek(max(0, path.stat().st_size - 4))
            tail = f.read(4)
        if head != b"PAR1" or tail != b"PAR1":
            return "not a Parquet file (it does not start and end with Parquet's PAR1 marker)"
    return None


def load_table(source: str, split: str = "train") -> Any:
    """A `datasets.Dataset`: a data file (JSONL, JSON, CSV, Parquet, Arrow), a directory saved
    with `save_to_disk`, a directory of data files, or a hub id given to `load_dataset`."""
    datasets = _datasets()
    if is_live(source):
        return _in_memory(live_object(source, "dataset"), split, source)
    path = Path(source).expanduser()
    try:
        if path.is_file():
            builder = FORMATS.get(path.suffix.lower())
            if builder is None:
                raise UserError(
                    f"dataset {source}: unsupported format {path.suffix or '(no suffix)'!r}; "
                    f"use one of {', '.join(FORMATS)} or a save_to_disk directory"
                )
            if path.stat().st_size == 0:
                raise UserError(f"dataset {source} is empty; give it at least one row")
            _only_train(split, source)
            table = datasets.load_dataset(builder, data_files=str(path), split="train")
        elif path.is_dir():
            if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
                table = datasets.load_from_disk(str(path))
                if isinstance(table, datasets.DatasetDict):
                    table = _pick_split(table, split, source)
                else:
                    _only_train(split, source)
            else:
                table = datasets.load_dataset(str(path), split=split)
        elif source.startswith((".", "/", "~")) or path.suffix.lower() in FORMATS:
            where = (
                "" if path.is_absolute() else f" (relative to the current directory, {Path.cwd()})"
            )
            raise UserError(f"dataset {source} does not exist{where}; check the path")
        else:
            table = datasets.load_dataset(source, split=split)
    except UserError:
        raise
    except ValueError as err:
        if "corresponds to no data" in str(err):  # e.g. a CSV file with a header only
            raise UserError(f"dataset {source} has no rows; give it at least one") from None
        if "split" in str(err).lower():
            raise UserError(f"dataset {source} has no split {split!r}: {one_line(err)}") from None
        raise UserError(_unreadable(source, path, err)) from None
    except StopIteration:  # an empty JSON file
        raise UserError(f"dataset {source} is empty; give it at least one row") from None
    except Exception as err:  # parse errors, hub lookups offline, ...
        if not path.exists():
            raise UserError(
                f"dataset {source!r} is not a local file or directory and could not be loaded "
                f"as a hub dataset ({one_line(err)}); give a path to a data file"
            ) from None
        raise UserError(_unreadable(source, path, err)) from None
    if len(table) == 0:
        raise UserError(f"dataset {source} has no rows; give it at least one")
    return table


def _only_train(split: str, source: str) -> None:
    """A single data file (or saved Dataset) is one split, which `datasets` calls train."""
    if split != "train":
        raise UserError(
            f"dataset {source} is a single file, which has no split {split!r} (only train); "
            "give those rows as a file of their own (e.g. --eval-dataset test.jsonl)"
        )


def _in_memory(data: Any, split: str, source: str) -> Any:
    """A live dataset as a `datasets.Dataset`: a Dataset as it is, a DatasetDict's `split`, a
    list of dicts (rows in TRL's columns), or an IterableDataset read once to the end."""
    datasets = _datasets()
    if isinstance(data, datasets.DatasetDict):
        return _pick_split(data, split, source)
    if isinstance(data, datasets.Dataset):
        return data
    if isinstance(data, datasets.IterableDataset):
        return datasets.Dataset.from_list(list(data))
    if isinstance(data, (list, tuple)) and all(isinstance(row, dict) for row in data):
        if not data:
            raise UserError(f"dataset {source} has no rows; give it at least one")
        return datasets.Dataset.from_list(list(data))
    raise UserError(
        f"dataset {source} is a {type(data).__name__}; give a path, a datasets.Dataset or "
        "DatasetDict, or a list of dicts (one per row, TRL's columns)"
    )


def _pick_split(tables: Any, split: str, source: str) -> Any:
    if split not in tables:
        raise UserError(
            f"dataset {source} has no split {split!r}; splits: {', '.join(tables)} "
            "(choose one with --dataset-split)"
        )
    return tables[split]


# ---------------------------------------------------------------------------------------------
# Schema checks


def _feature_at(features: Any, path: str, source: str, flag: str) -> Any:
    """The feature a (dotted) column path names; UserError listing the columns when none."""
    if path in features:
        return features[path]
    parts = path.split(".")
    node, walked = features, []
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            where = f"fields of {'.'.join(walked)!r}" if walked else "columns"
            found = ", ".join(node) if isinstance(node, dict) else "none"
            raise UserError(
                f"dataset {source} has no column {path!r} ({where}: {found}); name the column "
                f"with {flag}"
            )
        node, walked = node[part], [*walked, part]
    return node


def _is_string(feature: Any) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def _is_messages(feature: Any) -> bool:
    inner = (
        feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    )
    return isinstance(inner, dict) and "role" in inner and "content" in inner


def _is_json(feature: Any) -> bool:
    """Free-form JSON (values whose structure differs between rows, or a list of them): checked
    row by row when read."""
    inner = getattr(feature, "feature", feature)
    return type(feature).__name__ == "Json" or type(inner).__name__ == "Json"


def _template_fields(template: str) -> list[str]:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as err:
        raise UserError(f"--prompt-template is not a valid format string: {err}") from None
    if not fields:
        raise UserError("--prompt-template names no column; write it like 'Question: {question}'")
    roots = [f.split(".")[0].split("[")[0] for f in fields]
    if any(not root for root in roots):
        raise UserError("--prompt-template fields must name columns, e.g. {question}")
    return roots


def check_schema(table: Any, fmt: RowFormat, source: str) -> bool:
    """Check the columns `fmt` reads against the table's schema; True when prompts are
    conversational (message lists)."""
    features = table.features
    if fmt.prompt_template is not None:
        for root in _template_fields(fmt.prompt_template):
            if root not in features:
                raise UserError(
                    f"--prompt-template names {{{root}}} but dataset {source} has no column "
                    f"{root!r} (columns: {', '.join(features)})"
                )
        conversational, strings = False, True
    else:
        feature = _feature_at(features, fmt.prompt_column, source, "--prompt-column")
        conversational = _is_messages(feature)
        strings = _is_string(feature)
        if not (conversational or strings or _is_json(feature)):
            raise UserError(
                f"dataset {source}: column {fmt.prompt_column!r} holds {feature}; a prompt must "
                "be a string or a list of {role, content} messages (or build one with "
                "--prompt-template)"
            )
    if fmt.answer_column is not None:
        _feature_at(features, fmt.answer_column, source, "--answer-column")
    warn_unread_image_columns(features, source)
    if fmt.system_prompt is not None and strings and not fmt.chat_template:
        raise UserError(
            "--system-prompt needs chat prompts: the dataset's prompts are strings; add "
            "--chat-template to send them as user messages"
        )
    return conversational


# ---------------------------------------------------------------------------------------------
# Rows


def _get(row: dict, path: str) -> Any:
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _messages(value: Any, where: str) -> list[dict]:
    ok = isinstance(value, list) and len(value) > 0
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and _content(m.get("content"))
        for m in value
    )
    if not ok:
        raise UserError(
            f"{where}: the prompt is neither a string nor a list of {{role, content}} messages"
        )
    return [{"role": m["role"], "content": _parts(m["content"])} for m in value]


def _content(content: Any) -> bool:
    """A message's content: a string, or a list of {"type": "text" | "image", ...} parts."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in ("text", "image") for p in content
    )


def _parts(content: Any) -> Any:
    """A content list's parts without the keys Arrow fills with None for other part types (a
    text part's "image": None); a string as it is."""
    if isinstance(content, str):
        return content
    return [{k: v for k, v in p.items() if v is not None or k == "type"} for p in content]


def _raw_prompt(row: dict, fmt: RowFormat, where: str) -> Any:
    """The prompt column's value, or the template filled with the row's columns."""
    if fmt.prompt_template is None:
        return _get(row, fmt.prompt_column)
    try:
        return fmt.prompt_template.format_map(row)
    except (KeyError, IndexError, AttributeError, ValueError, TypeError) as err:
        raise UserError(f"{where}: --prompt-template cannot be filled: {err!r}") from None


def format_prompt(row: dict, fmt: RowFormat, where: str) -> str | list[dict]:
    """The prompt of a dataset row: a string, or chat messages (see the module docstring)."""
    value = _raw_prompt(row, fmt, where)
    if value is None:
        raise UserError(f"{where}: the prompt is missing (null)")
    if isinstance(value, str):
        if not value.strip():
            raise UserError(f"{where}: the prompt is empty")
        if not fmt.chat_template:
            return value
        value = [{"role": "user", "content": value}]
    messages = _messages(value, where)
    if fmt.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": fmt.system_prompt}, *messages]
    return messages


class Rows(Sequence):
    """Rows `indices` of an Arrow-backed dataset, each formatted as a task row when read."""

    def __init__(self, table: Any, indices: np.ndarray, fmt: RowFormat, source: str) -> None:
        self.table, self.indices, self.fmt, self.source = table, indices, fmt, source

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        position = int(self.indices[index])
        raw = self.table[position]
        where = f"dataset {self.source}, row {position}"
        row = {**raw, "prompt": format_prompt(raw, self.fmt, where)}
        if self.fmt.answer_column is not None:
            row["answer"] = _get(raw, self.fmt.answer_column)
        return row


# ---------------------------------------------------------------------------------------------
# The held-out split


def _prompt_keys(table: Any, fmt: RowFormat, source: str) -> list[str]:
    """A string per row that identifies its prompt (before any chat template or system prompt),
    read in Arrow batches of the columns the prompt comes from."""
    if fmt.prompt_template is not None:
        columns = sorted(set(_template_fields(fmt.prompt_template)))
    elif fmt.prompt_column in table.column_names:
        columns = [fmt.prompt_column]
    else:
        columns = [fmt.prompt_column.split(".")[0]]
    plain = fmt.prompt_template is None and columns == [fmt.prompt_column]
    keys: list[str] = []
    view = table.select_columns(columns).with_format("arrow")
    for batch in view.iter(batch_size=50_000):
        if plain:
            values = batch.column(0).to_pylist()
        else:
            first = len(keys)
            values = [
                _raw_prompt(row, fmt, f"dataset {source}, row {first + i}")
                for i, row in enumerate(batch.to_pylist())
            ]
        keys += [
            v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str) for v in values
        ]
    images = [c for c in IMAGE_COLUMNS if c in table.column_names]
    if images:  # two rows that ask the same of different images are different prompts
        view = table.select_columns(images).with_format("arrow")
        at = 0
        for batch in view.iter(batch_size=1_000):
            for row in batch.to_pylist():
                keys[at] += "\x00" + image_digest(row)
                at += 1
    return keys


def heldout_count(rows: int, fraction: float) -> int:
    """`fraction` of `rows`, at least MIN_HELDOUT and at most MAX_HELDOUT, at most half."""
    return min(max(round(fraction * rows), MIN_HELDOUT), MAX_HELDOUT, rows // 2)


def split_by_hash(table: Any, fmt: RowFormat, fraction: float, source: str):
    """(train indices, held-out indices), each in file order: the held-out rows are those with
    the `heldout_count` smallest BLAKE2b hashes of their prompt. Rows with the same prompt fall
    on the same side, so the count can be off by the duplicates at the boundary."""
    n = len(table)
    k = heldout_count(n, fraction)
    if k < 1:
        raise UserError(
            f"dataset {source} has {n} row(s): too few to hold any out for evaluation; give "
            "more rows or an --eval-dataset"
        )
    keys = _prompt_keys(table, fmt, source)
    hashes = np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
            for key in keys
        ),
        dtype=np.uint64,
        count=n,
    )
    threshold = np.partition(hashes, k - 1)[k - 1]
    heldout = hashes <= threshold
    if heldout.all():  # duplicates of the k-th prompt fill the dataset: keep them for training
        heldout = hashes < threshold
    if not heldout.any():
        raise UserError(
            f"every row of dataset {source} has the same prompt: nothing can be held out for "
            "evaluation; give an --eval-dataset"
        )
    held = int(heldout.sum())
    if k < MIN_HELDOUT:
        warnings.warn(
            f"dataset {source} has only {n} rows: {held} are held out for evaluation, "
            f"{n - held} train; pass --eval-dataset for a separate evaluation set",
            stacklevel=2,
        )
    return np.flatnonzero(~heldout), np.flatnonzero(heldout)


# ---------------------------------------------------------------------------------------------
# The task


def dataset_task(
    source: str,
    fmt: RowFormat,
    *,
    split: str = "train",
    eval_source: str | None = None,
    eval_split: str = "train",
    eval_fraction: float = 0.05,
    environment: bool = False,
    same_eval_source: bool = False,
) -> Task:
    """A task over a dataset: training rows, held-out rows (from `eval_source`, or a hash-chosen
    part of `source`), no reward functions of its own (name them with --rewards).

    With an `environment`, a dataset whose rows are all one prompt (a game's) is a source of
    episodes: every row trains, and the held-out evaluation runs fresh episodes of that prompt
    (unless another `eval_source` is given; the same one, `same_eval_source`, adds nothing)."""
    table = load_table(source, split)
    check_schema(table, fmt, source)
    if environment and len(set(_prompt_keys(table, fmt, source))) == 1:
        rows = Rows(table, np.arange(len(table)), fmt, source)
        own = eval_source is None or same_eval_source
        heldout = rows if own else _eval_rows(eval_source, eval_split, fmt)
        return Task(
            name=f"dataset:{source}", train=rows, heldout=heldout, reward_funcs={},
            reward_weights={}, stop=None, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, episodes=True,
            heldout_episodes=own,
        )  # fmt: skip
    if same_eval_source:
        raise UserError(
            f"--eval-dataset is --dataset and --eval-split is --dataset-split ({split}): "
            "evaluation would score training prompts; choose another split, or leave "
            "--eval-dataset out to hold out part of --dataset"
        )
    if eval_source is None:
        train_idx, heldout_idx = split_by_hash(table, fmt, eval_fraction, source)
        heldout = Rows(table, heldout_idx, fmt, source)
    else:
        train_idx = np.arange(len(table))
        heldout = _eval_rows(eval_source, eval_split, fmt)
    return Task(
        name=f"dataset:{source}",
        train=Rows(table, train_idx, fmt, source),
        heldout=heldout,
        reward_funcs={},
        reward_weights={},
        stop=None,
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
    )


def _eval_rows(source: str, split: str, fmt: RowFormat) -> Rows:
    table = load_table(source, split)
    check_schema(table, fmt, source)
    return Rows(table, np.arange(len(table)), fmt, source)


def environment_task(name: str) -> Task:
    """The task of an environment that owns its data: every row is an empty one (reset writes
    the prompt), training and held-out alike are fresh episodes, and the rewards are the
    environment's own or --rewards."""
    return Task(
        name=f"environment:{name}", train=[{}], heldout=[{}], reward_funcs={},
        reward_weights={}, stop=None, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, episodes=True,
        heldout_episodes=True,
    )  # fmt: skip


class PromptStream:
    """Rows of a split in a seeded random order, epoch after epoch: the rows at a position.

    The position is the caller's (a run keeps it in its state, so a resume continues exactly);
    the stream only caches the current epoch's permutation."""

    def __init__(self, rows: Sequence[dict], seed: int):
        if len(rows) == 0:
            raise UserError("the task's train split is empty; give it at least one row")
        self.rows, self.seed = rows, seed
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def take(self, position: int, k: int) -> list[dict]:
        """The k rows from `position` on (position counts rows drawn since the start)."""
        out = []
        for at in range(position, position + k):
            epoch, index = divmod(at, len(self.rows))
            if epoch != self._epoch:
                gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._epoch, self._order = epoch, torch.randperm(len(self.rows), generator=gen)
            out.append(self.rows[int(self._order[index])])
        return out
