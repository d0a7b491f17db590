"""Experiment trackers a run also reports to: TensorBoard, Weights & Biases, trackio, MLflow.

The run directory's JSONL logs are the record (`doctor`, `compare` and resume read them); a
tracker mirrors them. Each tracker is an optional package imported only when named in
`--report-to`. What each receives: the resolved config and the run directory's path; every
train and eval metric under `train/NAME` and `eval/NAME` at its step; at each evaluation, a table
of the completions sampled since the previous one; the run's plots when it ends.

Resume continues the same tracker run where the tracker can (`trackers.json` in the run
directory records each one's run id and the last step of each stream it was sent), and a step is
never sent twice: records at or below a stream's last sent step are skipped, and records the
tracker missed (a crash before it got them, a tracker added on resume) are sent from the JSONL
logs when it starts. A tracker that raises warns once and is sent nothing more; training goes on.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from grouprl.errors import UserError, one_line
from grouprl.report.runs import read_jsonl

RECORD = "trackers.json"
STREAMS = ("train", "eval", "samples", "plots")


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _cell(value: Any) -> Any:
    """A table cell: numbers and text as they are, anything else as JSON text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value, default=str)


class _Backend:
    """One tracker. `start` returns what resuming it needs (saved in trackers.json)."""

    name = ""

    def start(self, *, config: dict, run_name: str, run_dir: Path, saved: dict) -> dict:
        return {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        pass

    def images(self, step: int, paths: list[Path]) -> None:
        pass

    def finish(self, ok: bool) -> None:
        pass


class _TensorBoard(_Backend):
    """Event files in run_dir/tensorboard. On a resumed run TensorBoard itself drops what was
    logged at `purge_step` and after (the replayed steps), so nothing is skipped here."""

    name = "tensorboard"
    replays = True

    def __init__(self, purge_step: int | None):
        self.purge_step = purge_step

    def start(self, *, config: dict, run_name: str, run_dir: Path, saved: dict) -> dict:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            log_dir=str(run_dir / "tensorboard"), purge_step=self.purge_step
        )
        return {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, ok: bool) -> None:
        self.writer.close()


class _Wandb(_Backend):
    """wandb.init with the run's id (resume="allow"): online, a resumed run continues the same
    W&B run. Its files go to run_dir/wandb unless WANDB_DIR says otherwise; WANDB_PROJECT,
    WANDB_ENTITY, WANDB_MODE and the rest are wandb's own."""

    name = "wandb"

    def start(self, *, config: dict, run_name: str, run_dir: Path, saved: dict) -> dict:
        import wandb

        self.wandb = wandb
        run_id = saved.get("id") or os.environ.get("WANDB_RUN_ID") or secrets.token_hex(4)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "grouprl"),
            name=run_name,
            id=run_id,
            resume="allow",
            config=config,
            allow_val_change=True,  # a resumed run may change --steps and the like
            dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
            reinit="create_new",
        )
        return {"id": self.run.id}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({"samples": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def images(self, step: int, paths: list[Path]) -> None:
        self.run.log({f"plots/{p.stem}": self.wandb.Image(str(p)) for p in paths}, step=step)

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class _Trackio(_Backend):
    """trackio.init(project, name, resume="allow"): the local store (TRACKIO_DIR) or a Space
    (TRACKIO_SPACE_ID); the project is TRACKIO_PROJECT, else grouprl. A resumed run continues the
    run of the same name."""

    name = "trackio"

    def start(self, *, config: dict, run_name: str, run_dir: Path, saved: dict) -> dict:
        import trackio

        self.trackio = trackio
        project = saved.get("project") or os.environ.get("TRACKIO_PROJECT", "grouprl")
        name = saved.get("name") or run_name
        self.run = trackio.init(
            project=project,
            name=name,
            config=config,
            resume="allow",
            space_id=os.environ.get("TRACKIO_SPACE_ID"),
            embed=False,
        )
        return {"project": project, "name": name}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({"samples": self.trackio.Table(columns=columns, data=rows)}, step=step)

    def images(self, step: int, paths: list[Path]) -> None:
        self.run.log({f"plots/{p.stem}": self.trackio.Image(p) for p in paths}, step=step)

    def finish(self, ok: bool) -> None:
        if self.trackio.context_vars.current_run.get() is self.run:
            self.trackio.finish()  # also forgets the run, so trackio's exit hook does not finish it again
        else:
            self.run.finish()


class _Mlflow(_Backend):
    """An MLflow run through MlflowClient (no process-global active run): the tracking URI is
    MLFLOW_TRACKING_URI as given (a server, sqlite:///mlflow.db with the full mlflow package, a
    file: store), else the store an earlier part of this run used, else a local file store,
    ./mlruns under the working directory, as TRL's users get without setting anything. A store
    grouprl chose becomes this process's MLFLOW_TRACKING_URI (MLflow's table and artifact
    helpers read it; the lowest version allowed logged tables to ./mlruns otherwise), with
    MLFLOW_ALLOW_FILE_STORE=true, without which newer MLflow refuses a file store. The
    experiment is MLFLOW_EXPERIMENT_NAME (created if missing), else MLflow's default. The config
    becomes params; MLflow refuses to change a param, so a resumed run adds only new ones."""

    name = "mlflow"

    def __init__(self, say: Callable[[str], None] = print):
        self.say = say

    def start(self, *, config: dict, run_name: str, run_dir: Path, saved: dict) -> dict:
        from mlflow import MlflowClient

        given = os.environ.get("MLFLOW_TRACKING_URI")
        uri = given or saved.get("uri") or (Path.cwd() / "mlruns").resolve().as_uri()
        if not given:  # MLflow's own helpers (tables, artifacts) read the process's URI
            os.environ["MLFLOW_TRACKING_URI"] = uri
            if uri.startswith("file:"):
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if not given and not saved.get("uri"):
            self.say(f"mlflow: no MLFLOW_TRACKING_URI, so runs go to the local store {uri} "
                     f"(see them with: mlflow ui --backend-store-uri {uri})")  # fmt: skip
        try:
            self.client = MlflowClient(tracking_uri=uri)
            return {**self._start(self.client, config, run_name, run_dir, saved), "uri": uri}
        except Exception as err:
            if given:
                raise
            raise UserError(
                f"--report-to mlflow: the local store {uri} failed ({one_line(err)}); set "
                "MLFLOW_TRACKING_URI (a tracking server's http:// address, or sqlite:///mlflow.db "
                "with the full mlflow package)"
            ) from err

    def _start(self, client: Any, config: dict, run_name: str, run_dir: Path, saved: dict) -> dict:
        from mlflow.entities import Param

        if saved.get("id"):
            self.run_id = saved["id"]
            client.update_run(self.run_id, status="RUNNING")
            have = client.get_run(self.run_id).data.params
        else:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_ID") or self._experiment(client)
            tags = {"grouprl.run_dir": str(run_dir)}
            self.run_id = client.create_run(experiment, run_name=run_name, tags=tags).info.run_id
            have = {}
        params = [Param(k, str(v)[:6000]) for k, v in config.items() if k not in have]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            client.log_batch(self.run_id, params=params[i : i + 100])
        return {"id": self.run_id}

    @staticmethod
    def _experiment(client: Any) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return "0"  # MLflow's Default experiment
        found = client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else client.create_experiment(name)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        data = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, data, f"samples/step_{step:06d}.json")

    def images(self, step: int, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), "plots")

    def finish(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


#: Each tracker `--report-to` may name (`grouprl.config.options.TRACKERS`) and its backend.
BACKENDS: dict[str, type[_Backend]] = {
    "tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio, "mlflow": _Mlflow,
}  # fmt: skip


class Trackers:
    """The trackers `--report-to` names, for one run directory (rank 0 only)."""

    def __init__(
        self,
        run_dir: Path,
        names: Iterable[str],
        *,
        config: dict[str, Any],
        run_name: str | None = None,
        purge_step: int | None = None,
        warn: Callable[[str], None] = print,
        say: Callable[[str], None] = print,
    ):
        self.run_dir, self.warn = Path(run_dir), warn
        path = self.run_dir / RECORD
        self.record: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}
        self.live: list[_Backend] = []
        config = {**config, "run_dir": str(self.run_dir)}
        # TensorBoard last: a tracker that cannot start then leaves no event files behind
        for name in sorted(names, key=lambda n: n == "tensorboard"):
            backend = (
                _TensorBoard(purge_step)
                if name == "tensorboard"
                else _Mlflow(say)
                if name == "mlflow"
                else BACKENDS[name]()
            )
            saved = self.record.get(name, {})
            try:
                resume = backend.start(
                    config=config, run_name=run_name or self.run_dir.name, run_dir=self.run_dir,
                    saved=saved,
                )  # fmt: skip
            except UserError:
                self.close(ok=False)
                raise
            except Exception as err:
                self.close(ok=False)
                raise UserError(
                    f"--report-to {name}: could not start ({one_line(err)}); fix its settings, "
                    f"or leave {name} out of --report-to"
                ) from err
            self.record[name] = {**saved, **resume, "sent": saved.get("sent", {})}
            self.live.append(backend)
        self._save()
        self._catch_up()

    def _sent(self, backend: _Backend, stream: str) -> int:
        if getattr(backend, "replays", False):
            return -1
        return self.record[backend.name]["sent"].get(stream, -1)

    def _send(
        self, stream: str, step: int, call: Callable[[_Backend], None], *, catch_up: bool = False
    ) -> None:
        changed = False
        for backend in list(self.live):
            if step <= self._sent(backend, stream) or (catch_up and getattr(backend, "replays", 0)):
                continue  # a step this tracker already has
            try:
                call(backend)
            except Exception as err:
                self.live.remove(backend)
                self.warn(
                    f"{backend.name} failed ({one_line(err)}); nothing more is sent to it. "
                    f"Training goes on, and the run directory keeps every metric"
                )
                continue
            if not getattr(backend, "replays", False):
                self.record[backend.name]["sent"][stream] = step
                changed = True
        if changed:
            self._save()

    def _save(self) -> None:
        tmp = self.run_dir / (RECORD + ".tmp")
        tmp.write_text(json.dumps(self.record, indent=1) + "\n")
        os.replace(tmp, self.run_dir / RECORD)

    def _catch_up(self) -> None:
        """What the JSONL logs hold that a tracker was never sent (they end at the step the run
        resumes from)."""
        for stream, name in (("train", "metrics.jsonl"), ("eval", "eval.jsonl")):
            for record in _read_jsonl(self.run_dir / name):
                self.log(stream, record["step"], record, catch_up=True)

    def log(
        self, stream: str, step: int, metrics: dict[str, Any], *, catch_up: bool = False
    ) -> None:
        """stream: train or eval; metrics go under stream/NAME."""
        values = {f"{stream}/{k}": v for k, v in _numbers(metrics).items() if k != "step"}
        self._send(stream, step, lambda b: b.log(step, values), catch_up=catch_up)

    def samples_table(self, step: int) -> None:
        """To each tracker, the completions samples.jsonl holds after its previous table, up to
        `step`."""
        samples = _read_jsonl(self.run_dir / "samples.jsonl")

        def send(backend: _Backend) -> None:
            since = self._sent(backend, "samples")
            rows = [r for r in samples if since < r["step"] <= step]
            if rows:
                columns = list(dict.fromkeys(k for r in rows for k in r))
                backend.table(step, columns, [[_cell(r.get(c)) for c in columns] for r in rows])

        self._send("samples", step, send)

    def images(self, step: int, paths: list[Path]) -> None:
        if paths:
            self._send("plots", step, lambda b: b.images(step, paths))

    def close(self, ok: bool = True) -> None:
        for backend in self.live:
            try:
                backend.finish(ok)
            except Exception as err:
                self.warn(f"{backend.name} failed to finish ({one_line(err)})")
        self.live = []


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a run's JSONL log that carry a step."""
    return [r for r in read_jsonl(path) if isinstance(r.get("step"), int)]
