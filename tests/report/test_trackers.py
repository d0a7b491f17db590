"""--report-to: every tracker gets the config and each metric at its step, once, across a
resume; each is read back with its own local reader; a tracker that fails mid-run warns once and
training goes on; an unknown or uninstalled tracker is one line before anything starts."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import uuid
from pathlib import Path

import pytest

from grouprl.cli import main
from grouprl.report import trackers as trackers_module

# found, not imported: trackio reads TRACKIO_DIR when first imported. Another test of this process
# may have imported it first (TRL imports it), leaving trackio on its default store: the fixture
# gives trackio a project of this test's own, so that store's earlier runs are never read here.
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mlflow", "trackio", "wandb")),
    reason="the tracker extras are not installed: pip install -e '.[trackers]'",
)

TINY = ["--prompts-per-step", "4", "--group-size", "2", "--eval-size", "2", "--eval-samples",
        "1", "--threads", "1", "--no-progress", "--log-ratios", "0"]  # fmt: skip


@pytest.fixture
def local_stores(tmp_path, monkeypatch):
    """Each tracker on a store in tmp_path, offline; nothing reaches a network."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "grouprl-tests")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("TRACKIO_PROJECT", f"grouprl-tests-{uuid.uuid4().hex}")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    return tmp_path


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _wandb_records(path: Path):
    """The records of an offline run's .wandb file: wandb's own protobuf `Record`s in the
    LevelDB-log framing wandb writes (a 7-byte file header, 32 KiB blocks, each chunk a 7-byte
    header of CRC, length and type: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += room
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_history(run: Path) -> tuple[list[dict], dict]:
    """Every history row of every offline run directory of `run` (a resume writes a second
    one with the same run id), and the config of the first."""
    rows, config = [], None
    for file in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        for record in _wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                # a key with "/" is stored split, as nested_key
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in record.history.item})  # fmt: skip
            elif kind == "run" and config is None:
                config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
    return rows, config


def test_every_tracker_gets_the_config_and_each_step_once_across_a_resume(
    local_stores, stop_at, capsys
):
    """A run killed after step 3 (no checkpoint since step 2) resumes and replays step 3; no
    tracker gets a step twice, and each holds every step of metrics.jsonl with its values."""
    run = local_stores / "run"
    stop_at(3, error=RuntimeError("killed"))  # dies without saving, as a SIGKILL would
    with pytest.raises(RuntimeError):
        main(["train", "--steps", "4", "--save-every", "2", "--eval-every", "2", "--output-dir",
              str(run), "--report-to", "tensorboard,wandb", "trackio", "mlflow",
              "--run-name", "tiny", *TINY])  # fmt: skip
    stop_at(None)
    assert main(["train", "--resume", str(run)]) == 0
    metrics = _jsonl(run / "metrics.jsonl")
    evals = _jsonl(run / "eval.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    loss = {m["step"]: m["loss"] for m in metrics}
    record = json.loads((run / "trackers.json").read_text())
    assert record["mlflow"]["sent"]["train"] == 4 and record["wandb"]["sent"]["eval"] == 4

    # MLflow: its client on the file store
    from mlflow import MlflowClient

    client = MlflowClient()
    mlflow_run = client.get_run(record["mlflow"]["id"])
    assert mlflow_run.info.run_name == "tiny" and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["steps"] == "4"
    assert mlflow_run.data.params["run_dir"] == str(run)
    history = client.get_metric_history(mlflow_run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == sorted(loss.items())
    assert [
        m.step for m in client.get_metric_history(mlflow_run.info.run_id, "eval/pass_at_1")
    ] == [e["step"] for e in evals]

    # trackio: its local store
    from trackio.sqlite_storage import SQLiteStorage

    project = os.environ["TRACKIO_PROJECT"]
    logs = SQLiteStorage.get_logs(project, "tiny")
    train_rows = [r for r in logs if "train/loss" in r]
    assert [(r["step"], r["train/loss"]) for r in train_rows] == sorted(loss.items())
    assert SQLiteStorage.get_run_config(project, "tiny")["steps"] == 4

    # W&B offline: the run's own .wandb files
    rows, config = _wandb_history(run)
    steps = [r["_step"] for r in rows if "train/loss" in r]
    assert steps == [1, 2, 3, 4]
    assert {r["_step"]: r["train/loss"] for r in rows if "train/loss" in r} == loss
    assert config["steps"] == 4 and config["run_dir"] == str(run)
    # the completions table at each evaluation: those sampled since the last one
    tables = {r["_step"]: r["samples/nrows"] for r in rows if "samples/nrows" in r}
    per_step = [s["step"] for s in _jsonl(run / "samples.jsonl")]
    assert tables == {2: per_step.count(1) + per_step.count(2),
                      4: per_step.count(3) + per_step.count(4)}  # fmt: skip
    assert any(k.startswith("plots/") for r in rows for k in r)  # the plots, at the end
    assert len({p.name.rsplit("-", 1)[-1] for p in run.glob("wandb/offline-run-*")}) == 1  # one id


def test_a_tracker_that_fails_mid_run_warns_once_and_training_goes_on(
    local_stores, monkeypatch, capsys
):
    calls = []

    def fails_after_the_first(self, step, metrics):
        calls.append(step)
        if len(calls) > 1:
            raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(trackers_module._Mlflow, "log", fails_after_the_first)
    run = local_stores / "run"
    assert main(["train", "--steps", "3", "--output-dir", str(run), "--report-to", "mlflow",
                 *TINY]) == 0  # fmt: skip
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("mlflow failed (ConnectionError: tracking server unreachable)") == 1
    assert len(calls) == 2  # nothing was sent after the failure
    assert [m["step"] for m in _jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert (run / "final").is_dir()


def test_report_to_none_writes_only_the_run_directory(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--steps", "1", "--output-dir", str(run), "--report-to", "none",
                 *TINY]) == 0  # fmt: skip
    assert not (run / "tensorboard").exists()
    assert (run / "metrics.jsonl").exists() and (run / "plots").is_dir()


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("wandb", "--report-to wandb: wandb is not installed; pip install 'grouprl[wandb]'"),
        ("comet", "--report-to 'comet' is not a tracker grouprl knows; choose from"),
    ],
)
def test_an_uninstalled_or_unknown_tracker_is_one_line(
    tmp_path, monkeypatch, capsys, flag, message
):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "--report-to", flag, *TINY]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err
    assert not run.exists()


def test_every_tracker_the_config_accepts_has_a_backend():
    """The config owns the names `--report-to` takes (it imports no report module); each must
    have a backend here, and each backend a name there."""
    from grouprl.config.choices import TRACKERS
    from grouprl.report.trackers import BACKENDS

    assert set(BACKENDS) == set(TRACKERS)
    assert all(backend.name == name for name, backend in BACKENDS.items())


def test_mlflow_with_no_settings_logs_to_a_local_store_and_resumes_into_it(
    tmp_path, monkeypatch, stop_at, capsys
):
    """No MLFLOW_TRACKING_URI and no server: the runs go to ./mlruns (a file store, which the
    newest mlflow-skinny takes only with MLFLOW_ALLOW_FILE_STORE, set for this process), said
    in one line; a run that dies and resumes (from another directory) continues the same MLflow
    run and sends no step twice, as MLflow's own client reads back."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.setenv(name, "x")  # so that the teardown restores what was there
        monkeypatch.delenv(name)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    run = tmp_path / "run"
    stop_at(3, error=RuntimeError("killed"))  # dies after step 2 without saving step 3
    with pytest.raises(RuntimeError):
        main(["train", "--steps", "4", "--save-every", "2", "--eval-every", "2", "--output-dir",
              str(run), "--report-to", "mlflow", *TINY])  # fmt: skip
    stop_at(None)
    store = (work / "mlruns").resolve().as_uri()
    assert f"runs go to the local store {store}" in " ".join(capsys.readouterr().err.split())
    monkeypatch.chdir(tmp_path)  # resumed from elsewhere: the run's own store is used
    assert main(["train", "--resume", str(run)]) == 0
    assert not (tmp_path / "mlruns").exists()

    from mlflow import MlflowClient

    record = json.loads((run / "trackers.json").read_text())["mlflow"]
    assert record["uri"] == store
    client = MlflowClient(tracking_uri=store)
    history = client.get_metric_history(record["id"], "train/loss")
    loss = {m["step"]: m["loss"] for m in _jsonl(run / "metrics.jsonl")}
    assert sorted((m.step, m.value) for m in history) == sorted(loss.items())  # each step once
    assert client.get_run(record["id"]).info.status == "FINISHED"


def test_trl_names_rename_grouprls_metrics_for_trl_dashboards():
    from grouprl.report.sinks import trl_names

    metrics = {"reward_mean": 0.5, "reward_std": 0.25, "reward_right": 0.75,
               "reward_right_spread": 0.1, "reward_fmt": 0.25, "frac_zero_std": 0.5,
               "completion_len_mean": 7.0, "completion_len_max": 9.0, "truncated_frac": 0.125,
               "clip_frac_low": 0.0625, "clip_frac_high": 0.125, "entropy": 1.5, "lr": 1e-6,
               "loss": 0.3}  # fmt: skip
    assert trl_names(metrics) == {
        "reward": 0.5, "reward_std": 0.25, "rewards/fmt/mean": 0.25, "rewards/right/mean": 0.75,
        "frac_reward_zero_std": 0.5, "completions/mean_length": 7.0,
        "completions/max_length": 9.0, "completions/clipped_ratio": 0.125,
        "clip_ratio/low_mean": 0.0625, "clip_ratio/high_mean": 0.125,
        "clip_ratio/region_mean": 0.1875, "entropy": 1.5, "learning_rate": 1e-6,
    }  # fmt: skip


def test_trl_metrics_reach_the_trackers_and_not_the_jsonl(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--steps", "1", "--prompts-per-step", "4", "--group-size", "2",
                 "--eval-size", "2", "--eval-samples", "1", "--no-progress",
                 "--report-to", "tensorboard", "--trl-metrics", "--output-dir", str(run)]) == 0  # fmt: skip
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/reward", "train/rewards/correct/mean", "train/reward_mean"} <= tags
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward" not in first and "reward_mean" in first
