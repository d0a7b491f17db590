"""grouprl.trl.GRPOTrainer's run is, to the bit, grouprl.Trainer's with the mapped options;
TRL's callbacks see TRL's state and can stop the run; a second run into the same output_dir is
one line; a loaded model without processing_class gets its own tokenizer."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

import grouprl
from grouprl.errors import UserError
from grouprl.models.tiny import QWEN25_TOOLS, save_tiny_chat_model
from grouprl.trl import GRPOConfig, GRPOTrainer, options_from

ROWS = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "solution": str(a + b)}
        for a in range(10) for b in range(10)]  # fmt: skip
TIMINGS = {"step_seconds", "rollout_seconds", "tokens_per_s", "sampler_seconds", "update_seconds"}


def right(completions, solution, **kwargs):
    return [float(c[0]["content"].strip().endswith(s)) for c, s in zip(completions, solution)]


def short(completions, **kwargs):
    return [-len(c[0]["content"]) / 10 for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen")
    save_tiny_chat_model(directory, template=QWEN25_TOOLS)
    return str(directory)


def _args(output_dir, **changes) -> GRPOConfig:
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=4,
                    num_generations=4, steps_per_generation=2, num_iterations=2, max_steps=8,
                    max_completion_length=10, learning_rate=1e-3, beta=0.04,
                    loss_type="grpo", epsilon_high=0.28,
                    reward_weights=[1.0, 0.5], save_steps=4, bf16=False,
                    gradient_checkpointing=False, disable_tqdm=True)  # fmt: skip
    return GRPOConfig(**{**settings, **changes})


def _record(run) -> tuple:
    metrics = [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
               for line in (run / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    weights = load_file(str(run / "final" / "model.safetensors"))
    return (
        metrics,
        (run / "eval.jsonl").read_text(),
        (run / "samples.jsonl").read_text(),
        {k: v.tolist() for k, v in weights.items()},
    )


def test_the_shim_runs_the_python_apis_run_with_the_mapped_options(model_dir, tmp_path):
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    data = Dataset.from_list(ROWS)
    shim = GRPOTrainer(model=model_dir, reward_funcs=[right, short], args=_args(tmp_path / "shim"),
                       train_dataset=data, peft_config=lora)  # fmt: skip
    shim.train()
    options = {**options_from(_args(tmp_path / "api"), rows=len(ROWS))}
    # 8 completions a generation batch: 2 prompts; 2 minibatches x 2 iterations = 4 updates each
    assert (options["prompts_per_step"], options["minibatches"], options["steps"]) == (2, 2, 2)
    grouprl.Trainer(model=model_dir, train_dataset=data, rewards={right: 1.0, short: 0.5},
                    lora=lora, **options).train()  # fmt: skip
    ours, theirs = _record(tmp_path / "shim"), _record(tmp_path / "api")
    assert len(ours[0]) == 2 and ours == theirs
    # TRL's state, without callbacks too: two steps' logs (4 optimizer steps each) and 2 evals
    steps = [h["step"] for h in shim.state.log_history if "reward" in h]
    assert steps == [4, 8] and shim.state.global_step == 8


class Recorder(TrainerCallback):
    def __init__(self):
        self.seen, self.logs = [], []

    def on_train_begin(self, args, state, control, **kwargs):
        self.seen.append(("begin", state.max_steps))

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(("step", state.global_step))
        if state.global_step >= 4:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(logs)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.seen.append(("evaluate", state.global_step, sorted(metrics)[0]))

    def on_save(self, args, state, control, **kwargs):
        self.seen.append(("save", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.seen.append(("end", state.global_step, len(state.log_history)))


def test_trl_callbacks_see_trls_state_and_stop_the_run(model_dir, tmp_path):
    recorder = Recorder()
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # no processing_class: its own
    trainer = GRPOTrainer(model=model, reward_funcs=right, train_dataset=Dataset.from_list(ROWS),
                          args=_args(tmp_path / "run", eval_strategy="steps", eval_steps=4, reward_weights=None,
                                     save_steps=4), callbacks=[recorder])  # fmt: skip
    out = trainer.train()
    assert out.global_step == 4  # stopped after the first rollout (4 optimizer steps) of 2
    assert recorder.seen == [("begin", 8), ("evaluate", 0, "eval_greedy_pass_at_1"),
                             ("step", 4), ("save", 4), ("evaluate", 4, "eval_greedy_pass_at_1"),
                             ("end", 4, 3)]  # fmt: skip
    assert {"reward", "rewards/right/mean", "completions/mean_length", "loss"} <= set(
        recorder.logs[0]
    )
    assert trainer.state.log_history[1]["step"] == 4


def test_a_second_run_into_the_same_output_dir_is_one_line(model_dir, tmp_path):
    args = _args(tmp_path / "run", max_steps=4, beta=0.0, reward_weights=None)
    GRPOTrainer(model=model_dir, reward_funcs=right, args=args,
                train_dataset=Dataset.from_list(ROWS)).train()  # fmt: skip
    again = GRPOTrainer(model=model_dir, reward_funcs=right, args=args,
                        train_dataset=Dataset.from_list(ROWS))  # fmt: skip
    with pytest.raises(UserError, match="resume_from_checkpoint=True"):
        again.train()
    out = again.train(resume_from_checkpoint=True)  # a finished run: nothing more to do
    assert out.global_step == 4


def test_a_datasetdict_is_one_line_naming_its_splits(model_dir, tmp_path):
    from datasets import DatasetDict

    splits = DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS)})
    with pytest.raises(UserError, match=r"DatasetDict of splits \(train, test\); give one"):
        GRPOTrainer(model=model_dir, reward_funcs=right, train_dataset=splits,
                    args=_args(tmp_path / "run"))  # fmt: skip


def test_trls_async_trainer_is_grouprls_run_at_a_fixed_lag(model_dir, tmp_path):
    from grouprl.trl import AsyncGRPOConfig, AsyncGRPOTrainer
    from grouprl.trl.async_grpo import async_options_from

    data = Dataset.from_list(ROWS)

    def args(output_dir):
        return AsyncGRPOConfig(output_dir=str(output_dir), per_device_train_batch_size=4,
                               gradient_accumulation_steps=2, num_generations=4, max_steps=3,
                               max_completion_length=8, learning_rate=1e-3, max_staleness=1,
                               bf16=False, disable_tqdm=True)  # fmt: skip

    with pytest.warns(UserWarning, match="exactly that many optimizer steps before"):
        shim = AsyncGRPOTrainer(model=model_dir, reward_funcs=[right, short],
                                args=args(tmp_path / "shim"), train_dataset=data)  # fmt: skip
    shim.train()
    options = async_options_from(args(tmp_path / "api"), rows=len(ROWS))
    assert (options["prompts_per_step"], options["max_staleness"], options["proximal"]) == (
        2, 1, "behaviour")  # fmt: skip
    grouprl.Trainer(model=model_dir, train_dataset=data, rewards=[right, short],
                    **options).train()  # fmt: skip
    ours, theirs = _record(tmp_path / "shim"), _record(tmp_path / "api")
    assert len(ours[0]) == 3 and ours == theirs
    # each batch after the first sampled by the weights of one optimizer step before
    assert [m["staleness"] for m in ours[0]] == [0, 1, 1]
    with pytest.raises(UserError, match="weight_sync_steps=2"):
        AsyncGRPOTrainer(model=model_dir, reward_funcs=right, train_dataset=data,
                         args=AsyncGRPOConfig(weight_sync_steps=2, max_steps=2))  # fmt: skip
    with pytest.raises(UserError, match="rollout_worker"):
        AsyncGRPOTrainer(model=model_dir, reward_funcs=right, train_dataset=data,
                         rollout_worker=object())  # fmt: skip


def test_an_error_under_the_shim_names_trls_fields(model_dir, tmp_path):
    """Prompts too long for the model's context (1,024 tokens) after max_completion_length:
    the line says how long they are against what, and names what a TRL user can change
    (max_completion_length; TRL 1.16 has no max_prompt_length), not grouprl's flags."""
    rows = [{"prompt": [{"role": "user", "content": "1 " * 600 + f"+{i}="}], "solution": "0"}
            for i in range(40)]  # fmt: skip
    args = _args(tmp_path / "run", max_completion_length=512, max_steps=4, reward_weights=None)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=right, args=args,
                          train_dataset=Dataset.from_list(rows))  # fmt: skip
    with pytest.raises(UserError) as caught:
        trainer.train()
    message = str(caught.value)
    assert "fits the prompt budget of 512 tokens" in message and "the shortest is" in message
    assert (
        "; lower max_completion_length, shorten the prompts or use a model with a longer "
        "context" in message
    ), message
    assert "--" not in message, message
