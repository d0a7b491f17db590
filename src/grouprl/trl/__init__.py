"""TRL's `GRPOTrainer` (and `RLOOTrainer`) on grouprl: a script written for TRL runs after
changing one import.

    from grouprl.trl import GRPOConfig, GRPOTrainer       # was: from trl import ...

    trainer = GRPOTrainer(model=..., reward_funcs=[...], args=GRPOConfig(...),
                          train_dataset=..., peft_config=LoraConfig(...))
    trainer.train()

`GRPOConfig` has every field of TRL 1.16's, with TRL's types and defaults (a test holds it to the
installed TRL's), so TRL's `TrlParser` parses it from flags and YAML as TRL's; `trl` need not be
installed. Each field is mapped onto grouprl's options (`FIELDS` says
which; the docs' reference of grouprl trl says how), refused in one line when set to what grouprl does not
implement, or, when it concerns only TRL's plumbing (hub pushing, dataloader workers, ...),
listed in one warning; none is ignored silently. The run is `grouprl.Trainer`'s with the mapped
options (the same to the bit), so it has grouprl's run directory, exact resume, evaluations and
plots; the trackers also get TRL's metric names.

`fields` holds the table, `config` the mapping, `trainer` the trainer, `callbacks` TRL's
callbacks, `async_grpo` TRL's AsyncGRPOTrainer (grouprl's fixed-lag asynchronous runs), `rloo`
TRL's RLOOTrainer (its own advantage, KL and ratio), `scripts` TRL's `trl grpo` and `trl rloo`
commands (`grouprl trl grpo`, `grouprl trl rloo`).
"""

from grouprl.trl.async_grpo import ASYNC_FIELDS, AsyncGRPOConfig, AsyncGRPOTrainer
from grouprl.trl.config import FIELDS, GRPOConfig, options_from
from grouprl.trl.rloo import RLOO_FIELDS, RLOOConfig, RLOOTrainer
from grouprl.trl.trainer import GRPOTrainer

__all__ = ["ASYNC_FIELDS", "FIELDS", "RLOO_FIELDS", "AsyncGRPOConfig", "AsyncGRPOTrainer",
           "GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer", "options_from"]  # fmt: skip
