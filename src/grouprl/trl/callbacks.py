"""TRL's callbacks (transformers' `TrainerCallback`s) called from a grouprl run.

Called: on_train_begin, on_step_end and on_log (once per grouprl step, which is
minibatches x num_iterations of TRL's optimizer steps: `state.global_step` advances by that
many), on_evaluate (metrics under `eval_` names), on_save, on_train_end, each with
(args, state, control) and `logs=`/`metrics=` where TRL passes them. `state` is a transformers
`TrainerState` (global_step, max_steps, log_history, is_world_process_zero);
`control.should_training_stop` ends the run after the current step. Not called: on_init_end,
on_epoch_begin/end, on_step_begin, on_substep_end, on_pre_optimizer_step, on_optimizer_step,
on_prediction_step, on_predict (grouprl's loop has no such moments, or makes them elsewhere).
"""

from __future__ import annotations

import os
from typing import Any

from grouprl.report.sinks import trl_names
from grouprl.train.events import RunEvent


class TRLCallbacks:
    """One grouprl callback that calls TRL-style callbacks with TRL's state and control."""

    def __init__(self, trainer: Any, callbacks: list[Any]) -> None:
        from transformers import TrainerControl, TrainerState

        self.trainer = trainer
        self.callbacks = [c() if isinstance(c, type) else c for c in callbacks]
        options = trainer.options
        self.per_step = options["minibatches"] * options["epochs"]
        self.state = TrainerState(
            max_steps=options["steps"] * self.per_step,
            is_world_process_zero=int(os.environ.get("RANK", "0")) == 0,
        )
        self.control = TrainerControl()
        trainer.state = self.state

    def _call(self, name: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is not None:
                method(self.trainer.args, self.state, self.control, **kwargs)

    def begin(self) -> None:
        self._call("on_train_begin")

    def end(self) -> None:
        self._call("on_train_end")

    def __call__(self, event: RunEvent) -> None:
        self.state.global_step = event.step * self.per_step
        if event.kind == "step":
            metrics = dict(event.metrics)
            logs = {**trl_names(metrics), "loss": metrics.get("loss"),
                    "grad_norm": metrics.get("grad_norm")}  # fmt: skip
            self.state.log_history.append({**logs, "step": self.state.global_step})
            self._call("on_step_end")
            self._call("on_log", logs=logs)
        elif event.kind == "evaluation":
            scores = {f"eval_{k}": v for k, v in event.metrics.items()}
            self.state.log_history.append({**scores, "step": self.state.global_step})
            self._call("on_evaluate", metrics=scores)
        elif event.kind == "save":
            self._call("on_save")
        if self.control.should_training_stop:
            event.stop()
