"""grouprl from Python: a run given live objects only (a reward and a tool defined here, a
`datasets.Dataset`, a loaded model and tokenizer, a `LoraConfig`, an environment class, a
callback that stops early) is, to the bit, the command line's run of the same settings written
as files; a resume with the same objects continues it exactly, and one with a changed reward is
refused in one line."""

from __future__ import annotations

import inspect
import json
import random
import signal

import datasets
import pytest
import yaml
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import grouprl
from grouprl.cli import main
from grouprl.models import resolve_model_path
from grouprl.tasks import get_task


def right(completions, answer, **kwargs):
    """1 when the answer after the last `|` of the last turn is the row's (with tools a
    completion is its turns, as TRL passes them)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if t.rpartition("|")[2].strip() == str(a) else 0.0
            for t, a in zip(texts, answer)]  # fmt: skip


def double(x: int) -> int:
    """Twice a number.

    Args:
        x: the number.
    """
    return 2 * x


class Vault:
    def reset(self, key, addend, seed, **row):
        self.key, self.addend = int(key), int(addend)
        self.value = random.Random(seed).randint(10, 99)
        self.answer = None

    def lookup(self, key: int) -> int:
        """The value stored under a key.

        Args:
            key: the key to look up.
        """
        if key != self.key:
            raise KeyError(f"no key {key}")
        return self.value

    def step(self, text):
        tail = text.rpartition("|")[2].strip()
        self.answer = int(tail) if tail.isdigit() else None

    def get_reward(self):
        return 1.0 if self.answer == self.value + self.addend else 0.0


ROWS = [dict(row) for row in get_task("lookup").train[:96]]
SETTINGS = dict(steps=4, prompts_per_step=4, group_size=4, max_new_tokens=48, eval_size=4,
                eval_samples=2, eval_every=2, save_every=1, threads=1, progress=False,
                report_to=["none"], log_ratios=0, lr=1e-3)  # fmt: skip
FLAGS = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "48", "--eval-size",
         "4", "--eval-samples", "2", "--eval-every", "2", "--save-every", "1", "--threads", "1",
         "--no-progress", "--report-to", "none", "--log-ratios", "0", "--lr", "1e-3"]  # fmt: skip
DROP = {"step_seconds", "rollout_seconds", "tokens_per_s"}


def stop_after(step: int):
    def callback(event):
        if event.kind == "step" and event.step == step:
            event.stop()

    return callback


def _live(**overrides) -> grouprl.Trainer:
    path = resolve_model_path("builtin:lookup")
    objects = dict(
        model=AutoModelForCausalLM.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        train_dataset=datasets.Dataset.from_list(ROWS),
        rewards=[right],
        tools=[double],
        environment=Vault,
        lora=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    )
    return grouprl.Trainer(**{**objects, **SETTINGS, **overrides})


def _record(run) -> tuple:
    metrics = [{k: v for k, v in json.loads(line).items() if k not in DROP}
               for line in (run / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    evals = (run / "eval.jsonl").read_text()
    samples = (run / "samples.jsonl").read_text()
    return metrics, evals, samples


def _weights(run) -> dict:
    return load_file(str(run / "final" / "model.safetensors"))


def _same_weights(a, b) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same objects as files, for the command line."""
    root = tmp_path_factory.mktemp("api")
    (root / "rewards.py").write_text(inspect.getsource(right))
    (root / "tools.py").write_text(inspect.getsource(double))
    (root / "env.py").write_text("import random\n\n\n" + inspect.getsource(Vault))
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return root


def test_live_objects_train_the_command_lines_run_to_the_bit(files, tmp_path):
    trainer = _live(callbacks=[stop_after(2)], output_dir=tmp_path / "live")
    given = trainer.model
    before = {k: v.clone() for k, v in given.state_dict().items()}
    result = trainer.train()
    assert result.steps_done == 2 and [m["step"] for m in result.metrics] == [1, 2]
    last = json.loads((tmp_path / "live" / "eval.jsonl").read_text().splitlines()[-1])
    assert last.pop("step") == 2 and result.final_eval == last
    # the caller's model is untouched (LoRA went on a copy); the trained one is on the trainer
    assert given.state_dict().keys() == before.keys()
    assert all((given.state_dict()[k] == v).all() for k, v in before.items())
    trained = {
        k.removeprefix("base_model.model."): v for k, v in trainer.model.state_dict().items()
    }
    key = "model.layers.0.self_attn.q_proj.weight"  # LoRA merged into the returned model
    assert trainer.model is not given and not (trained[key] == before[key]).all()
    cli = tmp_path / "cli"
    assert main(["train", "--model", "builtin:lookup", "--dataset", str(files / "data.jsonl"),
                 "--rewards", f"{files / 'rewards.py'}:right", "1.0",
                 "--tools", f"{files / 'tools.py'}:double",
                 "--environment", f"{files / 'env.py'}:Vault",
                 "--lora-r", "2", "--lora-alpha", "4", "--lora-target-modules", "q_proj", "v_proj",
                 "--steps", "2", *FLAGS, "--output-dir", str(cli)]) == 0  # fmt: skip
    assert _record(tmp_path / "live") == _record(cli)
    assert _same_weights(tmp_path / "live", cli)
    record = yaml.safe_load((tmp_path / "live" / "config.yaml").read_text())
    assert record["model"] == "live:model" and record["rewards"] == {"live:right": 1.0}
    assert record["live"]["live:right"].endswith(
        "test_api.right source sha256:" + record["live"]["live:right"][-16:]
    )
    assert record["live"]["live:train_dataset"].startswith("rows sha256:")
    assert "parameters sha256:" in record["live"]["live:model"]


def test_a_resume_with_the_same_objects_continues_exactly_and_another_reward_is_refused(
    tmp_path, stop_at, capsys
):
    whole = _live(steps=3, output_dir=tmp_path / "whole").train()
    assert whole.steps_done == 3 and not whole.interrupted
    stop_at(1, signal.SIGINT)  # as Ctrl-C, or a notebook's stop button, during step 2
    handler = signal.getsignal(signal.SIGINT)
    cut = _live(steps=3, output_dir=tmp_path / "cut").train()
    assert cut.interrupted and cut.steps_done == 2
    assert signal.getsignal(signal.SIGINT) is handler  # the caller's handler is back
    stop_at(None)

    def right(completions, answer, **kwargs):  # the same name, another source
        return [0.0 for _ in completions]

    with pytest.raises(grouprl.UserError, match="resume: right is not what") as err:
        _live(steps=3, rewards=[right], resume=tmp_path / "cut").train()
    assert "\n" not in str(err.value)
    resumed = _live(steps=3, resume=tmp_path / "cut").train()
    assert resumed.steps_done == 3 and resumed.final_eval == whole.final_eval
    assert _record(tmp_path / "cut") == _record(tmp_path / "whole")
    assert _same_weights(tmp_path / "cut", tmp_path / "whole")
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 2  # not from the command line
    assert "made from Python with live objects" in capsys.readouterr().err


def test_lambdas_and_closures_are_rewards_called_as_given(tmp_path):
    calls = []

    def closure(completions, **kwargs):
        calls.append(len(completions))
        return [0.5 for _ in completions]

    trainer = grouprl.Trainer(
        train_dataset=[{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)],
        rewards={closure: 1.0, (lambda completions, **kw: [1.0] * len(completions)): 0.5},
        steps=1, prompts_per_step=4, group_size=2, eval_size=2, eval_samples=1,
        max_new_tokens=38, threads=1, progress=False, report_to=["none"],
        output_dir=tmp_path / "run",
    )  # fmt: skip
    result = trainer.train()
    assert calls and result.metrics[0]["reward_lambda_1"] == 1.0
    assert result.metrics[0]["reward_closure"] == 0.5
    record = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert record["rewards"] == {"live:closure": 1.0, "live:lambda_1": 0.5}
    assert "<lambda> source sha256:" in record["live"]["live:lambda_1"]
    assert "<locals>.closure source sha256:" in record["live"]["live:closure"]


def test_mistakes_are_one_user_error():
    with pytest.raises(grouprl.UserError, match="did you mean 'group_size'"):
        grouprl.Trainer(grop_size=4)
    with pytest.raises(grouprl.UserError, match="use_dora"):
        _live(lora=LoraConfig(r=2, use_dora=True)).train()
    with pytest.raises(grouprl.UserError, match="pass tokenizer= too"):
        grouprl.Trainer(model=_live().model).train()


def test_a_lora_config_without_targets_means_pefts_default_for_the_architecture():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as known

    from grouprl.api import _lora_options

    llama = sorted(known["llama"])  # the built-in models are Llama-architecture
    for model in ("builtin:arith", _live().model):
        options = _lora_options(LoraConfig(r=2, lora_alpha=8, lora_dropout=0.1), model)
        assert options == {"lora_r": 2, "lora_alpha": 8.0, "lora_dropout": 0.1,
                           "lora_target_modules": llama}  # fmt: skip
    with pytest.raises(grouprl.UserError, match="as a regex"):
        _lora_options(LoraConfig(r=2, target_modules=".*proj"), "builtin:arith")
