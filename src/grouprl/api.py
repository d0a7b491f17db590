"""grouprl from Python: train, evaluate and generate with live objects, in a script or a notebook.

    import grouprl

    def right(completions, answer, **kwargs):          # TRL's reward signature
        return [float(c.rstrip().endswith(a)) for c, a in zip(completions, answer)]

    trainer = grouprl.Trainer(model="builtin:arith", train_dataset=rows, rewards=[right], steps=50)
    result = trainer.train()                           # a TrainResult; trainer.model is trained
    trainer.evaluate(), trainer.generate("12+34=")

A `Trainer` takes a `TrainConfig` (or its fields as keywords: every `grouprl train` option,
with the command line's defaults and validation) and, wherever the command line takes a spec, a
live object: a loaded model with its tokenizer, a `peft.LoraConfig`, a `datasets.Dataset`,
`DatasetDict` or list of dicts, reward functions (sync or async, lambdas and closures too) with
weights, tool functions, an environment class, callbacks. The run is the command line's run:
the same loop, checkpoints, logs, plots and trackers, in this process, to the bit (tested).

The run's config.yaml names each live object `live:NAME` and records what identifies it under
`live:` (`identity`): a function's module, qualified name and source hash; a dataset's rows'
hash; a model's name and parameters' hash. `resume=` takes the same objects again and refuses,
in one line, any that differ. A user's mistake raises `grouprl.UserError` with the command
line's message.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grouprl.config.options import EvalConfig, GenerateConfig, TrainConfig, field_names
from grouprl.errors import UserError
from grouprl.tasks.live import PREFIX, live_tokenizer, using

#: LoraConfig fields grouprl maps onto its options; any other field must keep peft's default.
_LORA_MAPPED = {"r", "lora_alpha", "lora_dropout", "target_modules"}
_LORA_IGNORED = {"task_type", "peft_type", "inference_mode", "base_model_name_or_path",
                 "revision", "auto_mapping", "runtime_config"}  # fmt: skip


@dataclass(frozen=True)
class TrainResult:
    """What `Trainer.train` returns: the run directory, the held-out metrics at the start and
    the end (None: stopped before the end), every step's metrics, and how it stopped."""

    run_dir: Path
    steps_done: int
    initial_eval: dict[str, float] | None
    final_eval: dict[str, float] | None
    metrics: list[dict[str, Any]]
    interrupted: bool = False
    stopped_by: str | None = None

    @property
    def dataframe(self) -> Any:
        """The steps' metrics as a pandas DataFrame, one row per step (needs pandas)."""
        try:
            import pandas
        except ImportError:
            raise UserError("TrainResult.dataframe needs pandas: pip install pandas") from None
        return pandas.DataFrame(self.metrics)


class Trainer:
    """A run from Python. `config`: a `TrainConfig` (default: the command line's defaults);
    `options`: any of its fields by keyword, over it. Live objects, wherever a spec would do:

    - `model`: a path, `builtin:NAME`, a hub id, a .gguf file, or a loaded `PreTrainedModel`
      (then `tokenizer=` too); `lora`: a `peft.LoraConfig` (r, lora_alpha, lora_dropout,
      target_modules, None meaning peft's default for the architecture; any other option it
      sets is refused in one line).
    - `train_dataset`, `eval_dataset`: a path or hub id, a `datasets.Dataset` / `DatasetDict`,
      a list of dicts (TRL's columns), or an `IterableDataset` (read once, to its end; only
      with an `eval_dataset`, since it cannot be held out from).
    - `rewards`: functions or specs, as a list (weight 1 each) or a mapping to weights.
    - `tools`: functions or specs; `environment`: a class or a spec.
    - `callbacks`: functions called with a `RunEvent` after every step, evaluation and
      checkpoint (or objects with `on_step`/`on_evaluate`/`on_save`); `event.stop()` ends the
      run after that step.
    - `resume`: a run directory to continue, given the same objects.

    Nothing passed in is changed: the run trains copies. After `train()`, `model` and
    `tokenizer` are the trained ones, and `result` what `train()` returned."""

    def __init__(
        self,
        config: TrainConfig | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        rewards: Any = None,
        tools: Any = None,
        environment: Any = None,
        lora: Any = None,
        callbacks: Sequence[Any] = (),
        resume: str | Path | None = None,
        **options: Any,
    ) -> None:
        _check_option_names(options)
        self.config, self.options = config, options
        self.model, self.tokenizer, self.lora = model, tokenizer, lora
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.rewards, self.tools, self.environment = rewards, tools, environment
        self.callbacks, self.resume = list(callbacks), resume
        self.result: TrainResult | None = None
        self._trained_config: TrainConfig | None = None

    # -- training --------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Train (or resume) in this process; returns a `TrainResult`. A KeyboardInterrupt
        (a notebook's stop button) finishes the step, saves and returns an interrupted result:
        `Trainer(..., resume=result.run_dir).train()` continues it."""
        from grouprl.quiet import quiet_hf

        quiet_hf()  # before the imports that bring in transformers
        from grouprl.train import loop

        live = _Live.of(self)
        cfg = self._run_config(live)
        with using(live.objects):
            summary = loop.train_and_leave(
                cfg, callbacks=[_callback(c) for c in self.callbacks], live=live.identities
            )
        self.model, self.tokenizer = summary.policy, summary.tokenizer
        self._trained_config = cfg
        self.result = TrainResult(
            summary.run_dir, summary.steps_done, summary.initial_eval, summary.final_eval,
            _read_metrics(summary.run_dir), summary.interrupted, summary.stopped_by,
        )  # fmt: skip
        return self.result

    def _run_config(self, live: _Live) -> TrainConfig:
        """The command line's config with the live objects' specs; for `resume`, the saved one
        with the changes asked, and the objects' identities checked against its record."""
        changes = {**self.options, **live.specs, **_lora_options(self.lora, self.model)}
        if self.resume is None:
            base = self.config or TrainConfig()
            return dataclasses.replace(base, **changes)
        from grouprl.config.parsing import resume_config

        same = {k: v for k, v in changes.items() if k not in live.specs}
        given = same.pop("output_dir", None)
        if given is not None and Path(given).resolve() != Path(self.resume).resolve():
            raise UserError(
                f"resume={self.resume} continues that run in its own directory; drop "
                f"output_dir={given} (or make it the same)"
            )
        cfg, recorded = resume_config(Path(self.resume), same)
        for spec, identity in live.identities.items():
            if recorded.get(spec) != identity:
                was = recorded.get(spec, "nothing")
                raise UserError(
                    f"resume: {spec.removeprefix(PREFIX)} is not what {self.resume} was given "
                    f"(now {identity}; recorded {was}); give the same object, or start a new "
                    "run"
                )
        missing = sorted(set(recorded) - set(live.identities))
        if missing:
            raise UserError(
                f"resume: {self.resume} was given {missing[0].removeprefix(PREFIX)}; give it "
                "again (the same object) to continue the run"
            )
        return cfg

    # -- after training ----------------------------------------------------------------------

    def evaluate(self, *, split: str = "heldout", limit: int = 200, samples: int = 8,
                 **options: Any) -> dict[str, Any]:  # fmt: skip
        """pass@1 (sampled and greedy) and pass@k of the trained model (before `train()`: of
        the model given) on the run's data, as `grouprl eval` reports them."""
        from grouprl.train.evaluate import evaluate_model

        cfg, objects = self._after_training(EvalConfig, split=split, limit=limit,
                                            samples=samples, **options)  # fmt: skip
        with using(objects):
            return evaluate_model(cfg, progress=False)

    def generate(self, prompt: str | None = None, *, samples: int = 1,
                 **options: Any) -> list[dict[str, Any]]:  # fmt: skip
        """Completions of the trained model (before `train()`: of the model given) for
        `prompt`, or for rows of the run's data (`split=`, `limit=`), rendered as training
        renders them: for each, the prompt as the model sees it and `samples` completions."""
        from grouprl.workflows.generate import load_generator

        cfg, objects = self._after_training(GenerateConfig, prompt=prompt, samples=samples,
                                            **options)  # fmt: skip
        with using(objects):
            return load_generator(cfg).complete()

    def _after_training(self, cls: type, **options: Any) -> tuple[Any, dict[str, Any]]:
        """`cls` (an eval or generate config) with the run's data, model and sampling options
        (those `options` does not set), on the trained model when there is one."""
        live = _Live.of(self)
        cfg = self._trained_config or dataclasses.replace(
            self.config or TrainConfig(), **self.options, **live.specs
        )
        objects = dict(live.objects)
        model = cfg.model
        if self.model is not None and not isinstance(self.model, str | Path):
            model = "live:model"
            objects.update({model: self.model, live_tokenizer(model): self.tokenizer})
        own = {f.name for f in dataclasses.fields(cls)} & set(field_names(TrainConfig))
        if cls is GenerateConfig:  # a free prompt has no answer for the run's rewards to read
            own -= {"rewards", "pass_reward"}
        shared = {name: getattr(cfg, name) for name in own if name not in options}
        return cls(**{**shared, **options, "model": model}), objects


# ---------------------------------------------------------------------------------------------
# Live objects: their specs in the config, and what identifies them


@dataclass
class _Live:
    """A trainer's live objects: the config fields that name them, the objects by spec, and
    what identifies each (recorded in config.yaml, checked on resume)."""

    specs: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    identities: dict[str, str] = field(default_factory=dict)

    def add(self, spec: str, obj: Any, identity_of: Callable[[Any], str]) -> str:
        if spec in self.objects and self.objects[spec] is not obj:
            raise UserError(f"two live objects are named {spec.removeprefix(PREFIX)}; rename one")
        self.objects[spec] = obj
        self.identities[spec] = identity_of(obj)
        return spec

    @classmethod
    def of(cls, trainer: Trainer) -> _Live:
        live = cls()
        model = trainer.model
        if model is not None and not isinstance(model, str | Path):
            if trainer.tokenizer is None:
                raise UserError("a loaded model needs its tokenizer: pass tokenizer= too")
            live.specs["model"] = live.add("live:model", model, model_identity)
            live.add(live_tokenizer("live:model"), trainer.tokenizer, tokenizer_identity)
        elif model is not None:
            live.specs["model"] = str(model)
        for name, key in (("train_dataset", "dataset"), ("eval_dataset", "eval_dataset")):
            data = getattr(trainer, name)
            if data is None:
                continue
            if isinstance(data, str | Path):
                live.specs[key] = str(data)
                continue
            _check_iterable(data, name, trainer.eval_dataset)
            live.specs[key] = live.add(f"live:{name}", data, dataset_identity)
        if trainer.rewards is not None:
            live.specs["rewards"] = live._rewards(trainer.rewards)
        if trainer.tools is not None:
            tools = trainer.tools if isinstance(trainer.tools, list | tuple) else [trainer.tools]
            live.specs["tools"] = [live._callable(t, "tool") for t in tools]
        if trainer.environment is not None:
            env = trainer.environment
            live.specs["environment"] = env if isinstance(env, str) else live.add(
                f"live:{getattr(env, '__name__', 'environment')}", env, callable_identity)  # fmt: skip
        return live

    def _rewards(self, rewards: Any) -> dict[str, float]:
        if callable(rewards) or isinstance(rewards, str):
            rewards = [rewards]
        pairs = rewards.items() if isinstance(rewards, Mapping) else ((r, 1.0) for r in rewards)
        return {self._callable(fn, "reward"): float(w) for fn, w in pairs}

    def _callable(self, fn: Any, what: str) -> str:
        if isinstance(fn, str):
            return fn
        if not callable(fn):
            raise UserError(
                f"a {what} must be a function or a spec string, not {type(fn).__name__}"
            )
        name = callable_name(fn)
        if name == "lambda":  # lambdas have no names of their own: number them
            name = f"lambda_{sum(s.startswith(PREFIX + 'lambda') for s in self.objects) + 1}"
        return self.add(f"{PREFIX}{name}", fn, callable_identity)


def callable_name(fn: Any) -> str:
    """A function's name, as metrics and calls name it: a partial's function's, a callable
    instance's class's, `lambda` for a lambda (numbered: lambda_1, lambda_2, ...)."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(inner, "__name__", None) or type(inner).__name__
    return "lambda" if name == "<lambda>" else name


def callable_identity(fn: Any) -> str:
    """What identifies a function, class or callable instance across processes and runs: its
    module, qualified name and the sha256 of its source (a lambda's is the line it is on). A
    `functools.partial` adds its bound arguments' reprs (memory addresses removed). Closure
    values and global state the code reads are not captured."""
    if isinstance(fn, functools.partial):
        bound = re.sub(r" at 0x[0-9a-fA-F]+", "", repr((fn.args, sorted(fn.keywords.items()))))
        return f"partial of {callable_identity(fn.func)} with {bound}"
    target = fn if inspect.isfunction(fn) or inspect.isclass(fn) or inspect.ismethod(fn) else (
        type(fn))  # fmt: skip
    try:
        source = textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError):  # defined where no source is kept (a REPL line): its code
        code = getattr(target, "__code__", None)
        source = repr(code.co_code) if code is not None else repr(target)
    kind = "instance of " if target is not fn else ""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"
    return f"{kind}{name} source sha256:{digest}"


def dataset_identity(data: Any) -> str:
    """What identifies a dataset: its rows' sha256 (their Arrow data, or their JSON)."""
    digest = hashlib.sha256()
    table = getattr(data, "data", None)
    if hasattr(data, "keys") and hasattr(data, "values") and not isinstance(data, list):
        for split in sorted(data.keys()):
            digest.update(f"{split}:{dataset_identity(data[split])}".encode())
    elif table is not None and hasattr(table, "to_batches"):
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        arrow = table.table if hasattr(table, "table") else table
        with pa.ipc.new_stream(sink, arrow.schema) as writer:
            writer.write_table(arrow.combine_chunks())
        digest.update(sink.getvalue().to_pybytes())
    else:
        for row in data:
            digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return f"rows sha256:{digest.hexdigest()[:16]}"


def model_identity(model: Any) -> str:
    """What identifies a model: its class, name or path, and the sha256 of its parameters."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(dtype=_byte()).numpy())
    where = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    return f"{type(model).__name__} {where} parameters sha256:{digest.hexdigest()[:16]}"


def tokenizer_identity(tokenizer: Any) -> str:
    """What identifies a tokenizer: its class, name or path, and the sha256 of its vocabulary,
    special tokens and chat template."""
    what = [sorted(tokenizer.get_vocab().items()), tokenizer.special_tokens_map,
            getattr(tokenizer, "chat_template", None)]  # fmt: skip
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
    where = getattr(tokenizer, "name_or_path", "")
    return f"{type(tokenizer).__name__} {where} vocabulary sha256:{digest[:16]}"


def _byte() -> Any:
    import torch

    return torch.uint8


def _check_iterable(data: Any, name: str, eval_dataset: Any) -> None:
    try:
        import datasets
    except ImportError:
        return
    if isinstance(data, datasets.IterableDataset) and eval_dataset is None:
        raise UserError(
            f"{name} is an IterableDataset, from which nothing can be held out for evaluation; "
            "give an eval_dataset too"
        )


def _lora_options(lora: Any, model: Any) -> dict[str, Any]:
    """A `peft.LoraConfig` as grouprl's LoRA options; one line for any option it sets that
    grouprl does not implement."""
    if lora is None:
        return {}
    from peft import LoraConfig

    if not isinstance(lora, LoraConfig):
        raise UserError(f"lora= takes a peft.LoraConfig, not a {type(lora).__name__}")
    default = LoraConfig()
    for f in dataclasses.fields(LoraConfig):
        name = f.name
        if name in _LORA_MAPPED or name in _LORA_IGNORED or name.startswith("_"):
            continue
        if getattr(lora, name) != getattr(default, name):
            raise UserError(
                f"LoraConfig({name}={getattr(lora, name)!r}): grouprl does not implement it; "
                "it takes r, lora_alpha, lora_dropout and target_modules"
            )
    targets = lora.target_modules
    if targets == "all-linear":  # peft's: every linear layer but the output head, as grouprl's
        targets = None
    elif targets is None:
        targets = _peft_default_targets(model)
    elif isinstance(targets, str):
        raise UserError("LoraConfig(target_modules=...) as a regex is not supported; list names")
    return {"lora_r": int(lora.r), "lora_alpha": float(lora.lora_alpha),
            "lora_dropout": float(lora.lora_dropout),
            "lora_target_modules": None if targets is None else sorted(targets)}  # fmt: skip


def _peft_default_targets(model: Any) -> list[str] | None:
    """peft's default target modules for the model's architecture, read from a loaded model or
    a model directory's config.json (None: grouprl's default, every linear layer but the head,
    when peft has none or the architecture cannot be read without loading, as for a GGUF)."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind is None and isinstance(model, (str, Path)):
        from grouprl.models import resolve_model_path

        config = Path(resolve_model_path(model)) / "config.json"
        if config.is_file():
            kind = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    if kind is None:
        return None
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as known

    return list(known[kind]) if kind in known else None


_METHODS = {"step": "on_step", "evaluation": "on_evaluate", "save": "on_save"}


def _callback(callback: Any) -> Callable[[Any], Any]:
    """A function of a `RunEvent`: the callback itself, or its on_step/on_evaluate/on_save
    methods."""
    if not any(hasattr(callback, name) for name in _METHODS.values()):
        if not callable(callback):
            raise UserError(f"a callback must be callable, not a {type(callback).__name__}")
        return callback

    def call(event: Any) -> Any:
        method = getattr(callback, _METHODS[event.kind], None)
        return None if method is None else method(event)

    call.__qualname__ = type(callback).__qualname__
    return call


def _check_option_names(options: Iterable[str]) -> None:
    known = field_names(TrainConfig)
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see grouprl train --help"
            raise UserError(f"Trainer got an unknown option {name!r}{hint}")


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
