"""Nothing lost, nothing silent: every run directory can be resumed, signals and user errors
save, finished runs stay finished, and preconditions fail before anything is written."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grouprl.cli import main
from grouprl.report.runs import finished_at
from grouprl.train import checkpoint as ckpt
from grouprl.train import loop
from grouprl.train import run as run_module

TINY = ["--prompts-per-step", "4", "--group-size", "2", "--eval-size", "2", "--eval-samples",
        "1", "--threads", "1", "--no-progress", "--save-every", "100"]  # fmt: skip


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def snapshot(path):
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_stop_during_the_first_evaluation_leaves_a_resumable_run(tmp_path, monkeypatch):
    """step_000000 is written before the first evaluation, so Ctrl-C there (or a kill) leaves
    a run that --resume continues to the same end as a run never stopped."""
    straight = tmp_path / "straight"
    assert main(["train", "--steps", "2", "--output-dir", str(straight), *TINY]) == 0
    original = loop.run_eval

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "run_eval", interrupted)
    broken = tmp_path / "broken"
    assert main(["train", "--steps", "2", "--output-dir", str(broken), *TINY]) == 130
    assert [p.name for p in ckpt.list_checkpoints(broken)] == ["step_000000"]
    monkeypatch.setattr(loop, "run_eval", original)
    assert main(["train", "--resume", str(broken)]) == 0
    assert (
        rows(broken / "metrics.jsonl")[-1]["loss"] == rows(straight / "metrics.jsonl")[-1]["loss"]
    )
    assert rows(broken / "eval.jsonl") == rows(straight / "eval.jsonl")
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(broken / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_saves_and_exits_143(tmp_path, stop_at, capsys):
    stop_at(1, signal.SIGTERM)
    run = tmp_path / "run"
    assert main(["train", "--steps", "4", "--output-dir", str(run), *TINY]) == 143
    err = " ".join(capsys.readouterr().err.split())
    assert "stopped by SIGTERM: saved a checkpoint at step 2" in err
    assert ckpt.latest_checkpoint(run).name == "step_000002"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler given back


def test_a_reward_that_raises_mid_run_saves_the_last_completed_step(tmp_path, stop_at):
    """The user's error ends the run with one line, after the last completed step is saved;
    fixed, the run resumes and ends exactly like one that never failed."""
    straight = tmp_path / "straight"
    assert main(["train", "--steps", "3", "--output-dir", str(straight), *TINY]) == 0
    from grouprl.errors import UserError

    stop_at(2, error=UserError("reward function 'x' raised ValueError: boom"))
    broken = tmp_path / "broken"
    assert main(["train", "--steps", "3", "--output-dir", str(broken), *TINY]) == 2
    assert ckpt.latest_checkpoint(broken).name == "step_000002"
    stop_at(None)
    assert main(["train", "--resume", str(broken)]) == 0
    drop = {"step_seconds", "rollout_seconds", "tokens_per_s"}

    def comparable(run):
        return [{k: v for k, v in r.items() if k not in drop} for r in rows(run / "metrics.jsonl")]

    assert comparable(broken) == comparable(straight)


def test_resuming_a_finished_run_changes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--steps", "1", "--output-dir", str(run), *TINY]) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    assert "already finished at step 1" in " ".join(capsys.readouterr().err.split())
    assert snapshot(run) == before


def test_tensorboard_replays_nothing_twice_after_a_resume(tmp_path, stop_at):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    stop_at(2)
    run = tmp_path / "run"
    assert main(["train", "--steps", "4", "--save-every", "1", "--output-dir", str(run),
                 *TINY[:-2]]) == 130  # fmt: skip
    stop_at(None)
    assert main(["train", "--resume", str(run)]) == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == [1, 2, 3, 4]


def test_preconditions_fail_before_anything_is_written(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    bert = tmp_path / "bert"
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(bert)  # fmt: skip
    from grouprl.models import build_char_tokenizer

    build_char_tokenizer().save_pretrained(bert)
    cases = [
        (["--output-dir", str(a_file / "run")], f"{a_file} is a file"),
        (["--model", str(bert), "--output-dir", str(tmp_path / "b")],
         "is not a causal LM whose weights are all there"),
        (["--max-new-tokens", "100000", "--output-dir", str(tmp_path / "c")],
         "100000 new tokens leave no room for a prompt in the model's context of 256 tokens; "
         "lower --max-new-tokens or use a model with a longer context"),
    ]  # fmt: skip
    for flags, message in cases:
        assert main(["train", *flags, "--steps", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_an_unwritable_output_directory_is_found_first(tmp_path, capsys, monkeypatch):
    """A read-only file system (simulated: access(2) says EROFS for it, as it would even for
    root) is reported before the model loads, and nothing is created."""
    locked = tmp_path / "readonly_mount"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: False if Path(path) == locked else real_access(path, mode)
    )
    loaded = []
    monkeypatch.setattr(run_module, "load_policy", lambda *a: loaded.append(1))
    assert main(["train", "--output-dir", str(locked / "run"), "--steps", "1"]) == 2
    assert "is not writable (permissions or a read-only file system)" in capsys.readouterr().err
    assert not loaded and not (locked / "run").exists()


def test_a_run_killed_in_its_final_evaluation_is_not_taken_for_finished(tmp_path, monkeypatch):
    """A run extended past an earlier end and stopped in its final evaluation still holds the
    old final/: the resume finishes it (final/ from the new end, its evaluation logged once)."""
    run = tmp_path / "run"
    assert main(["train", "--steps", "1", "--output-dir", str(run), *TINY]) == 0
    original = loop.run_eval

    def dies_in_the_final_evaluation(cfg, policy, sampler, heldout, step, **kwargs):
        if step == 2:
            raise KeyboardInterrupt  # as good as a kill: nothing after this point runs
        return original(cfg, policy, sampler, heldout, step, **kwargs)

    monkeypatch.setattr(loop, "run_eval", dies_in_the_final_evaluation)
    assert main(["train", "--resume", str(run), "--steps", "2"]) == 130
    assert finished_at(run) == 1  # the old final/ is still there
    monkeypatch.setattr(loop, "run_eval", original)
    assert main(["train", "--resume", str(run), "--steps", "2"]) == 0
    assert finished_at(run) == 2
    assert [r["step"] for r in rows(run / "eval.jsonl")] == [0, 1, 2]


def test_a_half_written_log_line_does_not_block_a_resume(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--steps", "1", "--output-dir", str(run), *TINY]) == 0
    with (run / "samples.jsonl").open("a") as f:
        f.write('{"step": 2, "completion": "abc')  # killed mid-write
    assert main(["train", "--resume", str(run), "--steps", "2"]) == 0
    assert "samples.jsonl: dropped a half-written line" in " ".join(capsys.readouterr().err.split())
    assert all(isinstance(r, dict) for r in rows(run / "samples.jsonl"))


@pytest.fixture
def fault_at(monkeypatch):
    """`fault_at("checkpoint:2:ENOSPC")`: arm grouprl.faults in this process (it reads
    GROUPRL_FAULT once; the plan and its counts are reset here and after the test)."""
    from grouprl import faults

    def arm(spec):
        monkeypatch.setenv("GROUPRL_FAULT", spec)
        monkeypatch.setattr(faults, "_plan", False)
        monkeypatch.setattr(faults, "_hits", {})

    return arm


@pytest.mark.parametrize(
    ("spec", "reason"),
    [("checkpoint:2:ENOSPC", "No space left on device"), ("log:2:EACCES", "Permission denied")],
)
def test_a_write_that_fails_ends_the_run_in_one_line_and_keeps_the_last_checkpoint(
    tmp_path, capsys, fault_at, spec, reason
):
    """A full disk while a checkpoint is written (the second: step 1's) or a permission error
    on a log line (step 2's) ends the run with one line that says what and what to do; the last
    complete checkpoint is intact and resumes to the same end as a run that never failed."""
    straight = tmp_path / "straight"
    assert main(["train", "--steps", "3", "--output-dir", str(straight), *TINY[:-2],
                 "--save-every", "1"]) == 0  # fmt: skip
    capsys.readouterr()
    fault_at(spec)
    run = tmp_path / "run"
    assert main(["train", "--steps", "3", "--output-dir", str(run), *TINY[:-2],
                 "--save-every", "1"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert reason in err[-1] and "free disk space or fix the permissions" in err[-1], err
    assert "Traceback" not in "\n".join(err)
    latest = ckpt.latest_checkpoint(run)
    assert ckpt.damage(latest) is None
    assert latest.name == ("step_000000" if spec.startswith("checkpoint") else "step_000002")
    fault_at("")
    assert main(["train", "--resume", str(run)]) == 0
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_run_state_reads_the_checkpoints_earlier_versions_wrote():
    """state.json as grouprl wrote it before `RunState` (the same keys), and an older one
    without the non-finite streak: both give the state a resume continues from."""
    from grouprl.train.run import RunState

    written = {"data_position": 8, "initial_eval": {"pass_at_1": 0.25}, "nonfinite_in_a_row": 1,
               "world_size": 1, "step": 2, "scheduler": {}, "optimizer": {},
               "python_random": [3, [], None]}  # fmt: skip
    assert RunState.from_json(written) == RunState(2, 8, 1, {"pass_at_1": 0.25})
    older = {k: v for k, v in written.items() if k != "nonfinite_in_a_row"}
    assert RunState.from_json(older) == RunState(2, 8, 0, {"pass_at_1": 0.25})
    assert RunState.from_json({**written, **RunState(2, 8, 1).to_json()}).initial_eval is None
