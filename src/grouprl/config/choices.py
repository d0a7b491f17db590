"""Every named option's values, once: the Literal choices of the options, and the trackers.

The presets, the advantage estimators and the objectives are registries
(`grouprl.config.presets.PRESETS`, `grouprl.core.registry`): their choices are read when a
parser is built, so a variant registered at run time is one. tests/config/test_config.py checks
that the other choices name exactly what the core registers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

import tyro

from grouprl.core.registry import ADVANTAGE_ESTIMATORS, OBJECTIVES


def _registered(names: Callable[[], Iterable[str]], default: str | None) -> Any:
    """A text field whose choices are `names()` when the command line is parsed (or `--help`
    printed), shown like a Literal's, with its default."""
    optional = default is None

    def choices() -> Any:
        listed = Literal[tuple(names())]  # type: ignore[misc]
        return listed | None if optional else listed

    hint = f"(default: {default})"
    base = str | None if optional else str
    return Annotated[base, tyro.conf.arg(constructor_factory=choices, help_behavior_hint=hint)]


def _presets() -> Iterable[str]:
    from grouprl.config.presets import PRESETS  # (it imports nothing of the options)

    return PRESETS


Algo = _registered(_presets, "gspo")  # grouprl.config.presets.PRESETS
Objective = _registered(lambda: OBJECTIVES, None)  # grouprl.core.registry.OBJECTIVES
AdvEstimator = _registered(lambda: ADVANTAGE_ESTIMATORS, None)  # ...ADVANTAGE_ESTIMATORS
Dtype = Literal["fp32", "bf16", "fp16"]
Precision = Literal["fp32", "bf16"]
Strategy = Literal["ddp", "fsdp"]
Packing = Literal["auto", "on", "off"]
RoutingReplay = Literal["off", "r2", "r3"]
LRSchedule = Literal["constant", "linear", "cosine"]
RatioLevel = Literal[
    "token", "sequence", "sequence_token", "sequence_sum"
]  # grouprl.core.RATIO_LEVELS
LossAgg = Literal[  # grouprl.core.AGGREGATIONS
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
AdvScale = Literal["group", "batch", "none", "whiten"]  # grouprl.core.ADVANTAGE_SCALES
KLEstimator = Literal["k1", "k2", "k3"]  # grouprl.core.KL_ESTIMATORS
EvalSplit = Literal["heldout", "train", "all"]
ToolFormat = Literal["tags", "chat"]
Engine = Literal["hf", "vllm"]  # grouprl.train.build.build_engine
VllmMode = Literal["colocate", "server"]
VllmDtype = Literal["auto", "float32", "bfloat16", "float16"]
CorrectionName = Literal[  # grouprl.core.CORRECTIONS
    "none",
    "token_tis",
    "seq_tis",
    "token_mis",
    "seq_mis",
    "icepop",
    "token_band",
    "geo_mask",
    "geo_mask_token_tis",
]
WeightLevel = Literal["token", "sequence"]  # grouprl.core.WEIGHT_LEVELS
MaskLevel = Literal["token", "sequence", "geometric"]  # grouprl.core.MASK_LEVELS
Proximal = Literal["recompute", "behaviour"]
TeacherLoss = Literal["advantage", "jsd"]


#: The trackers `--report-to` may name, with the module each needs and what installs it
#: (`grouprl.report.trackers` has a backend for each; a test checks they agree).
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "grouprl[wandb]"),
    "trackio": ("trackio", "grouprl[trackio]"),
    "mlflow": ("mlflow", "grouprl[mlflow]"),
}
