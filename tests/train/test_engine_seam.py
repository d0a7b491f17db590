"""One way to sample: training, evaluation, `check` and `generate` all call a `RolloutEngine`,
with exactly the arguments its protocol declares, prompts as token ids."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from pathlib import Path

import pytest

from grouprl.config import GenerateConfig, TrainConfig
from grouprl.rollout import HFRolloutEngine, Rollout, RolloutEngine
from grouprl.rollout.turns import TurnHandler
from grouprl.train import loop
from grouprl.train import run as run_module
from grouprl.workflows.check import CheckOptions, measure
from grouprl.workflows.generate import load_generator

VAULT = f"{Path(__file__).resolve().parents[2] / 'examples' / 'vault' / 'env.py'}:Vault"


class StrictEngine:
    """The protocol's `sample` and nothing more (no **kwargs): a caller that passes an argument
    the protocol does not declare fails with a TypeError. Records each call."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner, self.calls = inner, []

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        tools: TurnHandler | None = None,
    ) -> Rollout:
        assert all(isinstance(i, int) for p in prompts for i in p), "prompts arrive as ids"
        self.calls.append({"prompts": len(prompts), "group_size": group_size, "tools": tools})
        return self.inner.sample(
            prompts, group_size=group_size, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed, tools=tools,
        )  # fmt: skip

    def policy_updated(self, version: int) -> None:
        self.calls.append({"policy_updated": version})
        self.inner.policy_updated(version)

    def close(self) -> None:
        self.inner.close()


def test_the_engines_have_exactly_the_protocols_signature():
    from grouprl.rollout.vllm_engine import VLLMEngine

    for method in ("sample", "policy_updated", "close"):
        protocol = inspect.signature(getattr(RolloutEngine, method))
        for engine in (StrictEngine, HFRolloutEngine, VLLMEngine):
            assert inspect.signature(getattr(engine, method)) == protocol, (engine, method)
    with pytest.raises(TypeError, match="lockstep"):  # the strict engine can fail
        StrictEngine(None).sample([[1]], group_size=1, max_new_tokens=1, lockstep=None)


@pytest.fixture
def strict_runs(monkeypatch):
    """Every run set up from here on samples through a StrictEngine; the engines made."""
    made, original = [], run_module.setup_run

    def setup(cfg, **kwargs):
        run = original(cfg, **kwargs)
        run.sampler.engine = StrictEngine(run.sampler.engine)
        made.append(run.sampler.engine)
        return run

    monkeypatch.setattr(loop, "setup_run", setup)
    return made, setup


SMALL = dict(steps=1, prompts_per_step=4, group_size=2, eval_size=2, eval_samples=2,
             eval_every=0, progress=False, threads=1, log_ratios=0)  # fmt: skip


@pytest.mark.parametrize("environment", [False, True], ids=["plain", "environment"])
def test_training_evaluation_and_check_sample_through_the_engine(
    tmp_path, strict_runs, environment
):
    made, setup = strict_runs
    extra = dict(task="lookup", environment=VAULT) if environment else {}
    cfg = TrainConfig(**SMALL, **extra, output_dir=tmp_path / "run")
    assert loop.train(cfg).steps_done == 1
    (engine,) = made
    # one training step, and the held-out evaluations at its start and end (sampled, greedy);
    # the engine is told of the update between them
    assert [c.get("group_size", "updated") for c in engine.calls] == [2, 1, 2, "updated", 2, 1]
    assert engine.calls[3] == {"policy_updated": 1}
    engine.calls = [c for c in engine.calls if "policy_updated" not in c]
    assert all((c["tools"] is not None) == environment for c in engine.calls)
    run = setup(dataclasses.replace(cfg, output_dir=tmp_path / "check"))
    measure(run, CheckOptions(steps=1))
    sampled = [c for c in made[-1].calls if "group_size" in c]
    assert sampled and all(c["group_size"] == 2 for c in sampled)


def test_generate_samples_through_the_engine():
    generator = load_generator(GenerateConfig(limit=2, samples=3, threads=1))
    generator.engine = StrictEngine(generator.engine)
    results = generator.complete()
    assert len(results) == 2 and all(len(r["completions"]) == 3 for r in results)
    assert generator.engine.calls == [{"prompts": 2, "group_size": 3, "tools": None}]
