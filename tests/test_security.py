"""Model output is executed only inside the sandbox; nothing read from a run directory's data
files is evaluated, executed or unpickled. (A reward file named with --rewards and
--trust-remote-code run code by design; that is the user's choice, documented on the docs' Reliability page.)"""

from __future__ import annotations

import ast
import builtins
import pickle
from pathlib import Path

import pytest
import torch

import grouprl
from grouprl.sandbox import slots
from grouprl.sandbox.runtime import runtime
from grouprl.tasks.rewards.arithmetic import correct, format_
from grouprl.tasks.rewards.code import code, code_all
from grouprl.tasks.rewards.math import accuracy, think_format

SRC = Path(grouprl.__file__).parent
#: The one file that executes code: the sandbox's harness, which runs only inside the sandbox
#: (grouprl reads it as text and hands it to the sandboxed interpreter; it is never imported).
HARNESS = SRC / "sandbox" / "harness.py"
PAYLOADS = [
    "__import__('os').system('echo pwned')",
    "().__class__.__bases__[0].__subclasses__()",
    'eval("1+1")',
    "exec('x=1')",
    "lambda: open('/etc/passwd').read()",
]


def test_the_source_never_evaluates_executes_or_unpickles():
    """Outside the sandbox's harness, no eval/exec/compile; nowhere unpickling."""
    banned_calls = {"eval", "exec", "compile", "__import__"}
    banned_modules = {"pickle", "marshal", "shelve", "dill", "cloudpickle"}
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        calls = banned_calls - {"exec", "compile"} if path == HARNESS else banned_calls
        # (the harness and its workers pass plain data with marshal, inside the sandbox only)
        modules = banned_modules - {"marshal"} if path == HARNESS else banned_modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in calls, f"{path}:{node.lineno}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = f"{getattr(node.func.value, 'id', '')}.{node.func.attr}"
                assert name not in ("torch.load", "yaml.load", "yaml.unsafe_load"), (
                    f"{path}:{node.lineno}"
                )
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                assert not {n.split(".")[0] for n in names} & modules, f"{path}:{node.lineno}"


def test_hostile_completions_never_reach_eval_or_exec(monkeypatch):
    """Every built-in reward on completions that are Python: scored, never run. sympy may call
    eval on numbers it builds itself; no text of a completion may reach it."""
    seen: list[str] = []
    real_eval, real_exec = builtins.eval, builtins.exec

    def spy(real):
        def call(source, *args, **kwargs):
            if isinstance(source, str):  # code objects are modules being imported
                seen.append(source)
            return real(source, *args, **kwargs)

        return call

    monkeypatch.setattr(builtins, "eval", spy(real_eval))
    monkeypatch.setattr(builtins, "exec", spy(real_exec))
    completions = [
        wrap.format(p) for p in PAYLOADS
        for wrap in ("\\boxed{{{}}}", "<answer>{}</answer>", "#### {}", "{}", "|{}",
                     "<think>x</think> {}")
    ]  # fmt: skip
    answers = ["72"] * len(completions)
    for fn in (accuracy, think_format, correct, format_):
        scores = fn(completions, answer=answers)
        assert all(s in (0.0, 1.0, None) for s in scores)
    # fragments only the payloads hold (libraries exec their own generated code, e.g. mpmath)
    markers = ("echo pwned", "__subclasses__", "/etc/passwd", "x=1", '"1+1"', "__import__(")
    leaked = [s for s in seen if any(m in s for m in markers)]
    assert not leaked, leaked


def test_the_harness_is_never_imported():
    """No module imports the harness: it is text passed to the sandboxed interpreter."""
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert not any(n.endswith("sandbox.harness") for n in names), f"{path}:{node.lineno}"


def test_code_rewards_run_model_output_only_in_the_sandbox(monkeypatch):
    """The code rewards on hostile completions: nothing of them reaches eval/exec/compile in
    this process, and every process started is bwrap with every namespace unshared."""
    import subprocess

    seen: list[str] = []
    started: list[list[str]] = []
    real_popen = subprocess.Popen

    def spy(real):
        def call(source, *args, **kwargs):
            if isinstance(source, str):
                seen.append(source)
            return real(source, *args, **kwargs)

        return call

    class Watched(real_popen):
        def __init__(self, args, *rest, **kwargs):
            started.append(list(args))
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(builtins, "eval", spy(builtins.eval))
    monkeypatch.setattr(builtins, "exec", spy(builtins.exec))
    monkeypatch.setattr(builtins, "compile", spy(builtins.compile))
    monkeypatch.setattr(subprocess, "Popen", Watched)
    slots.close_all()  # so that the sandboxes the rewards use are started here, and watched
    payloads = [f"```python\n{p}\n```" for p in PAYLOADS] + PAYLOADS
    tests = [["assert f(1) == 1"]] * len(payloads)
    for fn in (code, code_all):
        scores = fn(payloads, test_list=tests)
        assert all(s == 0.0 for s in scores)
    markers = ("echo pwned", "__subclasses__", "/etc/passwd", "x=1", '"1+1"')
    assert not [s for s in seen if any(m in s for m in markers)]
    bwrap = str(runtime().bwrap)
    assert started and all(a[0] == bwrap and "--unshare-all" in a for a in started), started


def test_nothing_read_from_a_run_directory_is_unpickled(tmp_path, monkeypatch):
    """Resuming, evaluating a checkpoint and plotting read only safetensors, JSON and YAML."""
    from grouprl.cli import main

    run = tmp_path / "run"
    flags = ["--prompts-per-step", "4", "--group-size", "2", "--eval-size", "2",
             "--eval-samples", "1", "--threads", "1", "--no-progress", "--save-every", "1"]  # fmt: skip
    assert main(["train", "--steps", "1", "--output-dir", str(run), *flags]) == 0

    def refuse(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    assert main(["train", "--resume", str(run), "--steps", "2"]) == 0
    step = run / "checkpoints" / "step_000002"
    assert main(["eval", "--model", str(step), "--limit", "2", "--samples", "1", "--json"]) == 0
    assert main(["plot", str(run)]) == 0


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors"])
def test_a_pickle_planted_in_a_checkpoint_is_refused(tmp_path, name):
    """A checkpoint file replaced by a pickle fails its manifest check and is never loaded."""
    from grouprl.config import TrainConfig
    from grouprl.train import checkpoint as ckpt
    from grouprl.train.loop import train

    cfg = TrainConfig(steps=1, prompts_per_step=4, group_size=2, eval_size=2, eval_samples=1,
                      progress=False, threads=1, output_dir=tmp_path / "run")  # fmt: skip
    train(cfg)
    step = ckpt.latest_checkpoint(tmp_path / "run")
    (step / name).write_bytes(pickle.dumps({"payload": "x"}))
    reason = ckpt.damage(step)
    assert reason is not None and name in reason
