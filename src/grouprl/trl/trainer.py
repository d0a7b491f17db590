"""TRL's GRPOTrainer: its constructor and train(), running grouprl.Trainer with the options
`grouprl.trl.config` maps TRL's GRPOConfig onto."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from grouprl.api import Trainer, TrainResult
from grouprl.errors import UserError, option_names
from grouprl.trl.callbacks import TRLCallbacks
from grouprl.trl.config import OPTION_NAMES, GRPOConfig, options_from, refusal


class _Accelerator:
    """accelerate's Accelerator as TRL's scripts use it."""

    @property
    def process_index(self) -> int:
        return int(os.environ.get("RANK", "0"))

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)


class GRPOTrainer:
    """TRL 1.16's GRPOTrainer constructor and `train()`, running grouprl (see the module)."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable] | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ) -> None:
        unsupported = {"reward_processing_classes": reward_processing_classes,
                       "optimizers": None if optimizers == (None, None) else optimizers,
                       "quantization_config": quantization_config, "rollout_func": rollout_func}  # fmt: skip
        for name, value in unsupported.items():
            if value is not None:
                raise UserError(f"GRPOTrainer({name}=...): grouprl does not implement it")
        if isinstance(environment_factory, Mapping) or isinstance(eval_dataset, Mapping):
            raise UserError(
                "GRPOTrainer: a dict of environments or of eval datasets is not supported; give one"
            )
        if isinstance(train_dataset, Mapping):  # a DatasetDict: TRL takes one split
            raise UserError(
                f"train_dataset is a {type(train_dataset).__name__} of splits "
                f"({', '.join(map(str, train_dataset))}); give one, e.g. dataset['train']"
            )
        if reward_funcs is None and environment_factory is None:
            raise UserError("GRPOTrainer: give reward_funcs, or an environment_factory whose "
                            "environment scores itself (get_reward)")  # fmt: skip
        self.args = GRPOConfig() if args is None else args
        self.model, self.processing_class = model, processing_class
        self.reward_funcs = reward_funcs
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.peft_config, self.tools = peft_config, tools
        self.environment_factory = environment_factory
        self.callback_handlers = list(callbacks or [])
        self.state: Any = None  # TRL's TrainerState (log_history, global_step) once training
        self.result: TrainResult | None = None
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rows = len(train_dataset) if hasattr(train_dataset, "__len__") else None
        self.options = self._options(world, rows)
        if tools or environment_factory is not None:  # TRL's tool calls: the chat template's
            self.options["tool_format"] = "chat"

    def _options(self, world: int, rows: int | None) -> dict[str, Any]:
        return options_from(self.args, world=world, rows=rows, lora=self.peft_config is not None)

    @property
    def accelerator(self) -> _Accelerator:
        """What TRL's scripts read of accelerate's Accelerator: print, on the main process."""
        return _Accelerator()

    def end(self) -> None:
        """TRL's Trainer.end(): grouprl closes its trackers and process group itself."""

    def _rewards(self) -> Any:
        funcs = self.reward_funcs
        if funcs is None:
            return None
        funcs = list(funcs) if isinstance(funcs, list | tuple) else [funcs]
        weights = getattr(self.args, "reward_weights", None)  # AsyncGRPOConfig has none
        if weights is None:
            return funcs
        if len(weights) != len(funcs):
            raise refusal("reward_weights", weights,
                          f"give one weight per reward function ({len(funcs)})")  # fmt: skip
        return dict(zip(funcs, weights, strict=True))

    def _grouprl(self, resume: Path | None) -> Trainer:
        model, tokenizer = self.model, self.processing_class
        if not isinstance(model, str | Path) and tokenizer is None:
            from grouprl.models import load_tokenizer

            tokenizer = load_tokenizer(model.name_or_path)
        self._hooks = TRLCallbacks(self, self.callback_handlers)  # keeps self.state, as TRL does
        return Trainer(
            model=model, tokenizer=tokenizer, train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset, rewards=self._rewards(), tools=self.tools,
            environment=self.environment_factory, lora=self.peft_config,
            callbacks=[self._hooks], resume=resume, **self.options,
        )  # fmt: skip

    def train(self, resume_from_checkpoint: str | bool | None = None, **unsupported: Any) -> Any:
        """Train; returns TRL's TrainOutput (global_step, training_loss, metrics).
        `resume_from_checkpoint`: True (or args.resume_from_checkpoint) continues the run in
        output_dir; a path continues that run directory."""
        if any(v is not None for v in unsupported.values()):
            raise UserError(f"GRPOTrainer.train({', '.join(unsupported)}=...): not supported")
        resume = resume_from_checkpoint or self.args.resume_from_checkpoint
        run_dir = self.options["output_dir"] if resume is True else resume
        if not run_dir and (self.options["output_dir"] / "config.yaml").exists():
            raise UserError(
                f"output_dir {self.options['output_dir']} already holds a run; continue it with "
                "trainer.train(resume_from_checkpoint=True), or choose another output_dir"
            )
        with option_names(OPTION_NAMES):  # its messages in TRL's names
            trainer = self._grouprl(None if not run_dir else Path(run_dir))
            self._hooks.begin()
            self.result = trainer.train()
        self.model, self.processing_class = trainer.model, trainer.tokenizer
        self._hooks.end()
        from transformers.trainer_utils import TrainOutput

        per_step = self.options["minibatches"] * self.options["epochs"]
        losses = [m["loss"] for m in self.result.metrics if m.get("loss") is not None]
        loss = sum(losses) / len(losses) if losses else math.nan
        return TrainOutput(self.result.steps_done * per_step, loss,
                           {"train_loss": loss, **(self.result.final_eval or {})})  # fmt: skip

    def save_model(self, output_dir: str | None = None) -> None:
        """The trained model and tokenizer, by save_pretrained (after a LoRA run, its adapter,
        as TRL saves it; the run's final/ holds the merged model)."""
        target = Path(output_dir or self.options["output_dir"])
        self.model.save_pretrained(target)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(target)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        raise UserError("GRPOTrainer.push_to_hub: grouprl does not push; upload final/ yourself")
