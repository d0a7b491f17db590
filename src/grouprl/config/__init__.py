"""grouprl's configuration: the options of each command (`options`), the `--algo` presets
(`presets`) and the resolution to a frozen `RunConfig` (`resolution`), parsing of flags and YAML
through one parser (`parsing`), and the rules between settings (`validation`).

Nothing here imports torch or transformers, so every command's `--help` answers at once.
"""

from grouprl.config.options import EvalConfig, GenerateConfig, RunConfig, TrainConfig, field_names
from grouprl.config.parsing import from_mapping, load_yaml, parse_train_args, to_yaml
from grouprl.config.presets import PRESETS, Preset
from grouprl.config.resolution import resolve

__all__ = [
    "PRESETS",
    "EvalConfig",
    "GenerateConfig",
    "Preset",
    "RunConfig",
    "TrainConfig",
    "field_names",
    "from_mapping",
    "load_yaml",
    "parse_train_args",
    "resolve",
    "to_yaml",
]
