"""Supervised warm start (`grouprl sft`) on a task's worked solutions; it makes the base policy.

A plain supervised loop: each step draws `batch_size` training rows in order, writes each one's
worked solution (with column errors injected at rate `noise`, see
`grouprl.tasks.builtin.arithmetic.noisy_solution`), and minimises the cross-entropy of the completion
tokens (solution + EOS) given the prompt, with AdamW, linear warm-up and cosine decay. Prompt
and padding tokens carry no loss. The defaults are the recipe of the bundled model
`builtin:arith`:

    grouprl sft --output-dir src/grouprl/models/builtin/arith

Why the noise: RL with verifier rewards mostly sharpens a policy (pass@1 rises toward pass@k;
DeepSeekMath §5.2.2). A model fitted to traces with a wrong column digit 30% of the time keeps
the right digit most likely (greedy decoding is mostly right) but samples a wrong one often at
temperature 1: pass@1 well below pass@8, which is the room RL needs, and groups of 8 with mixed
rewards, which is the signal it needs.

Deterministic from `seed` on a given machine and thread count: the fresh model's weights, the
row order and the injected noise all derive from it.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from grouprl.errors import UserError
from grouprl.images import has_images
from grouprl.models import load_model, load_tokenizer, vision
from grouprl.models.lora import apply_lora, save_final
from grouprl.models.tiny import TinySize, build_tiny_llama, build_tiny_moe, build_tiny_vlm
from grouprl.models.tokenizer import build_char_tokenizer, save_tokenizer
from grouprl.rollout import encode_prompts
from grouprl.rollout.media import Media
from grouprl.tasks import Task, get_task
from grouprl.train.prompts import prompt_ids


@dataclass
class SFTConfig:
    """Supervised warm start: fit a causal LM to a task's worked solutions, optionally noisy."""

    output_dir: Path = Path("runs/sft")
    """Where the model and tokenizer are written (save_pretrained); must be empty or absent."""
    overwrite: bool = False
    """Write into a non-empty output directory (files of the same name are replaced)."""
    task: str = "arithmetic"
    """Task whose training split and worked solutions to fit (not with --data)."""
    data: str | None = None
    """Conversations to fit instead of a task's solutions: a data file, a save_to_disk
    directory or a hub id whose rows are TRL's conversational SFT shape (`messages` with
    assistant `tool_calls` and `tool` results, optional `tools` schemas); loss on the
    assistant's tokens only, encoded as `grouprl train --tool-format F` samples them. Needs
    --model (an instruct model with a chat template)."""
    tools: list[str] | None = None
    """With --data: the tools the conversations call (as `grouprl train --tools` names them),
    described in the prompts as training will describe them."""
    tool_format: Literal["tags", "chat"] = "tags"
    """With --data: how calls and results are written (as `grouprl train --tool-format`)."""
    tool_prompt: str = "auto"
    """With --data and the tags format: the tools' description (as `grouprl train
    --tool-prompt`: auto, default, none, or a Jinja template file)."""
    lora_r: int | None = None
    """Train LoRA adapters of this rank instead of every weight (merged into the written
    model). None: full fine-tuning."""
    lora_alpha: float | None = None
    """LoRA scaling numerator (None: 2 * lora_r)."""
    lora_target_modules: list[str] | None = None
    """LoRA target module names (None: every linear layer but the output head)."""
    model: str | None = None
    """Model to start from (directory or builtin:NAME). None: a fresh tiny Llama, char tokenizer."""
    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 64
    """Training rows per step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 100
    """Linear warm-up steps from 0 to lr; cosine decay to lr/10 after."""
    weight_decay: float = 0.01
    """AdamW weight decay (matrices only; norms and embeddings are not decayed)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0: off)."""
    noise: float = 0.3
    """Chance that a task's trace is made wrong (the trace follows the error). 0: clean. Not
    used with --data."""
    seed: int = 0
    """Seed of the model initialisation, the row order and the injected noise."""
    threads: int = 2
    """torch CPU threads."""
    hidden_size: int = 128
    """Fresh model: hidden size."""
    num_layers: int = 4
    """Fresh model: transformer layers."""
    num_heads: int = 4
    """Fresh model: attention heads."""
    intermediate_size: int = 512
    """Fresh model: MLP inner size."""
    num_experts: int = 0
    """Fresh model: 0 for a dense Llama; else a mixture-of-experts model (Qwen3-MoE) with this
    many experts per layer, each an MLP of inner size intermediate_size / experts_per_token (a
    token's compute as the dense model's), trained with the routers' balancing loss."""
    experts_per_token: int = 2
    """Fresh mixture-of-experts model: experts each token is routed to (top-k)."""
    router_aux_loss_coef: float = 0.01
    """Fresh mixture-of-experts model: the balancing loss's weight during this fit (Switch
    Transformer's 0.01), so that no expert is left unused."""
    log_every: int = 100
    """Print the mean loss every this many steps (0: only at the end)."""
    progress: bool = True
    """Show a progress bar."""


@dataclass(frozen=True)
class SFTResult:
    """What a run did: where it wrote, its final mean loss, how long it took."""

    output_dir: Path
    final_loss: float
    first_loss: float
    steps: int
    seconds: float


def _check_output_dir(cfg: SFTConfig) -> None:
    out = cfg.output_dir
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not cfg.overwrite:
        raise UserError(f"--output-dir {out} is not empty; choose another or pass --overwrite")


def _validate(cfg: SFTConfig) -> None:
    if cfg.steps < 1 or cfg.batch_size < 1:
        raise UserError(f"--steps and --batch-size must be >= 1, got {cfg.steps}, {cfg.batch_size}")
    if not 0.0 <= cfg.noise < 1.0:
        raise UserError(f"--noise must lie in [0, 1), got {cfg.noise}")
    if cfg.lr <= 0:
        raise UserError(f"--lr must be positive, got {cfg.lr}")
    if cfg.data is None and (cfg.tools or cfg.tool_format != "tags" or cfg.tool_prompt != "auto"):
        raise UserError("--tools, --tool-format and --tool-prompt describe the conversations of "
                        "--data; a task's traces (--task) bring their own")  # fmt: skip
    if cfg.hidden_size % cfg.num_heads:
        raise UserError(
            f"--hidden-size {cfg.hidden_size} must be divisible by --num-heads {cfg.num_heads}"
        )
    if cfg.num_experts and not 1 <= cfg.experts_per_token <= cfg.num_experts:
        raise UserError(f"--experts-per-token must lie in [1, --num-experts {cfg.num_experts}], "
                        f"got {cfg.experts_per_token}")  # fmt: skip
    if cfg.num_experts and cfg.model is not None:
        raise UserError("--num-experts shapes a fresh model; --model brings its own")


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr / 10 at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def encode_batch(
    tokenizer, prompts: list[str], completions: list[str | list[tuple[str, str]]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded [prompt (with BOS if the tokenizer adds it), completion, EOS] sequences.

    A completion is a string, or a transcript of (role, text) turns of a tool-use task, each
    turn encoded on its own as the sampler feeds them (a tool's observation is encoded once).
    Returns input_ids (R, L), attention_mask (R, L) and labels (R, L) with -100 on prompt,
    padding and tool positions, so the loss covers exactly what the policy writes and the EOS:
    a model fitted to tool turns would learn to invent tool outputs.
    """
    prompt_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    rows = []
    for completion in completions:
        turns = [("assistant", completion)] if isinstance(completion, str) else completion
        pieces = [(tokenizer(text, add_special_tokens=False)["input_ids"], role != "tool")
                  for role, text in turns]  # fmt: skip
        rows.append([*pieces, ([tokenizer.eos_token_id], True)])
    return padded(prompt_ids, rows, tokenizer.pad_token_id)


def padded(
    prompt_ids: list[list[int]], rows: list[list[tuple[list[int], bool]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded [prompt, pieces...] sequences: input_ids, attention_mask and labels (-100
    on the prompt, on padding and on pieces that carry no loss), each (R, L)."""
    flat = [[i for ids, _ in row for i in ids] for row in rows]
    trained = [[own for ids, own in row for _ in ids] for row in rows]
    length = max(len(p) + len(r) for p, r in zip(prompt_ids, flat))
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (p, r, own) in enumerate(zip(prompt_ids, flat, trained)):
        full = torch.tensor(p + r)
        input_ids[i, : len(full)] = full
        attention_mask[i, : len(full)] = 1
        keep = torch.tensor(own, dtype=torch.bool)
        labels[i, len(p) : len(full)] = torch.where(keep, full[len(p) :], -100)
    return input_ids, attention_mask, labels


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # Decay matrices only: decaying norm gains and the (tied) embedding hurts tiny models.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def train_sft(cfg: SFTConfig, console: Console | None = None) -> SFTResult:
    """Run the supervised warm start described by `cfg`; write the model; return a summary."""
    console = console or Console(stderr=True)
    _validate(cfg)
    _check_output_dir(cfg)
    task = None if cfg.data is not None else get_task(cfg.task)
    if (
        task is not None
        and cfg.noise > 0
        and task.noisy_solution is None
        and (task.transcript is None)
    ):
        raise UserError(f"task {cfg.task!r} has no noisy traces; use --noise 0")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        data = conversation_data(cfg) if cfg.data is not None else None
        return _train(cfg, task, data, console)
    finally:
        torch.set_num_threads(threads_before)


#: input_ids, attention_mask, labels (R, L) and the model's other inputs (a VLM's images)
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def task_batches(cfg: SFTConfig, task: Task, tokenizer: Any) -> Callable[[], Batch]:
    """Each call: `batch_size` training rows drawn from the seed's order, their worked
    solutions written (noisy at rate `noise`), encoded."""
    noise_rng = random.Random(f"sft-noise:{cfg.seed}")
    order_rng = random.Random(f"sft-order:{cfg.seed}")
    rows = task.train

    def draw() -> Batch:
        batch = [rows[order_rng.randrange(len(rows))] for _ in range(cfg.batch_size)]
        if task.transcript is not None:  # a tool-use task: turns, tool turns untrained
            completions = [task.transcript(r, noise_rng, cfg.noise) for r in batch]
        elif cfg.noise > 0:
            assert task.noisy_solution is not None
            completions = [task.noisy_solution(r, noise_rng, cfg.noise) for r in batch]
        else:
            completions = [r["solution"] for r in batch]
        if has_images(batch[0]):
            return image_batch(tokenizer, batch, completions)
        return (*encode_batch(tokenizer, [r["prompt"] for r in batch], completions), {})

    return draw


def image_batch(tokenizer, rows: list[dict], completions: list[str]) -> Batch:
    """Rows with images: each prompt as the sampler feeds it (its images expanded by the
    processor, `prompt_ids`), its completion and EOS after it, right-padded; and the images'
    tensors for the model's forward."""
    prompts = [prompt_ids(tokenizer, r["prompt"], row=r) for r in rows]
    pieces = [[(tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
                True)] for c in completions]  # fmt: skip
    input_ids, attention_mask, labels = padded([list(p) for p in prompts], pieces,
                                               tokenizer.pad_token_id)  # fmt: skip
    media = Media.of(prompts)
    assert media is not None  # every row has images
    inputs = media.inputs(input_ids.shape[1], torch.device("cpu"), right=True)  # as the ids
    return input_ids, attention_mask, labels, inputs


def conversation_data(cfg: SFTConfig) -> tuple[Any, list]:
    """--data's rows and --tools' functions, read before the model loads (a wrong path or tool
    is one line at once)."""
    from grouprl.tasks.builtin.code import BUILTIN_TOOLS
    from grouprl.tasks.data import load_table
    from grouprl.tasks.tools.calls import load_tools

    assert cfg.data is not None
    tools = load_tools(cfg.tools or [], BUILTIN_TOOLS)
    table = load_table(cfg.data)
    if len(table) == 0:
        raise UserError(f"--data {cfg.data} has no rows")
    return table, tools


def conversation_batches(
    cfg: SFTConfig, tokenizer: Any, table: Any, tools: list
) -> Callable[[], Batch]:
    """Each call: `batch_size` conversations of --data drawn from the seed's order, encoded
    (once, up front) as `grouprl train` samples them."""
    from grouprl.tasks.tools.chat import tool_schema
    from grouprl.tasks.tools.conversations import encode_chat, encode_tags
    from grouprl.tasks.tools.prompt import describe_schemas, describe_tools, load_template

    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"--data {cfg.data} holds conversations, and the model's tokenizer has "
                        "no chat template to render them; give --model an instruct model")  # fmt: skip
    template = load_template(cfg.tool_prompt) if cfg.tool_format == "tags" else None
    schemas = [tool_schema(t) for t in tools] or None  # chat: the template renders them
    described = describe_tools(tools, template) if tools and template is not None else None

    def encode(messages: list[dict], schemas: list[dict] | None) -> list[int]:
        return encode_prompts(tokenizer, [messages], tools=schemas)[0][0]

    encoded = []
    for i, row in enumerate(table):
        where = f"--data {cfg.data} row {i}"
        if cfg.tool_format == "chat":
            encoded.append(encode_chat(tokenizer, row, schemas, where, encode))
            continue
        description = described
        if description is None and template is not None and row.get("tools"):
            description = describe_schemas(row["tools"], template)
        encoded.append(encode_tags(tokenizer, row, description, where, encode))
    order_rng = random.Random(f"sft-order:{cfg.seed}")

    def draw() -> Batch:
        batch = [encoded[order_rng.randrange(len(encoded))] for _ in range(cfg.batch_size)]
        return (*padded([e.prompt for e in batch], [e.pieces for e in batch],
                        tokenizer.pad_token_id), {})  # fmt: skip

    return draw


def _policy(cfg: SFTConfig, images: bool = False) -> tuple[Any, torch.nn.Module]:
    """The tokenizer and model to fit: a fresh tiny Llama (for a task whose rows have `images`,
    a fresh tiny Idefics3 and its processor), or --model (with LoRA adapters)."""
    if cfg.model is None:
        if cfg.data is not None:
            raise UserError("--data needs --model: an instruct model with a chat template")
        if images:
            model, processor = build_tiny_vlm("idefics3", seed=cfg.seed)
            return vision.with_processor(processor.tokenizer, processor), model
        tokenizer = build_char_tokenizer()
        size = TinySize(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size)
        if cfg.num_experts:
            model = build_tiny_moe(tokenizer, size, cfg.num_experts, cfg.experts_per_token)
            model.config.output_router_logits = True  # its loss adds the balancing loss
            model.config.router_aux_loss_coef = cfg.router_aux_loss_coef
            return tokenizer, model
        return tokenizer, build_tiny_llama(tokenizer, size)
    tokenizer, model = load_tokenizer(cfg.model), load_model(cfg.model)
    if cfg.lora_r is not None:
        alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_r
        model = apply_lora(model, r=cfg.lora_r, alpha=alpha,
                           target_modules=cfg.lora_target_modules)  # fmt: skip
    return tokenizer, model


def _train(
    cfg: SFTConfig, task: Task | None, data: tuple[Any, list] | None, console: Console
) -> SFTResult:
    torch.manual_seed(cfg.seed)
    tokenizer, model = _policy(cfg, task is not None and has_images(task.train[0]))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    console.log(f"sft: {type(model).__name__} with {n_params / 1e6:.2f}M parameters"
                + (f" ({n_trained / 1e6:.2f}M trained)" if n_trained < n_params else ""))  # fmt: skip
    if task is not None:
        draw = task_batches(cfg, task, tokenizer)
    else:
        assert data is not None
        draw = conversation_batches(cfg, tokenizer, *data)
        console.log(f"sft: {len(data[0])} conversations from {cfg.data} ({cfg.tool_format} format)")

    optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr)
    device = next(model.parameters()).device
    start = time.perf_counter()
    losses: list[float] = []
    window: list[float] = []
    progress = Progress(
        TextColumn("sft"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not cfg.progress,
        transient=True,
    )
    with progress:
        bar = progress.add_task("sft", total=cfg.steps, loss="-")
        for step in range(cfg.steps):
            input_ids, attention_mask, labels, inputs = draw()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            inputs = {k: v.to(device) for k, v in inputs.items()}  # a VLM's images
            loss = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         labels=labels.to(device), **inputs).loss  # fmt: skip
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm > 0:
                params = [p for p in model.parameters() if p.requires_grad]
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            losses.append(loss.item())
            window.append(losses[-1])
            progress.update(bar, advance=1, loss=f"{losses[-1]:.3f}")
            if cfg.log_every and (step + 1) % cfg.log_every == 0:
                console.log(f"step {step + 1}/{cfg.steps}  loss {sum(window) / len(window):.4f}")
                window = []
    seconds = time.perf_counter() - start

    _save(cfg, model.eval(), tokenizer)
    span = max(1, min(50, len(losses) // 5))  # first/last losses averaged for the summary
    head, tail = losses[:span], losses[-span:]
    result = SFTResult(
        cfg.output_dir, sum(tail) / len(tail), sum(head) / len(head), cfg.steps, seconds
    )
    console.log(
        f"sft: {cfg.steps} steps in {seconds:.0f}s, loss {result.first_loss:.3f} -> "
        f"{result.final_loss:.3f}; wrote {cfg.output_dir}"
    )
    return result


def _save(cfg: SFTConfig, model: torch.nn.Module, tokenizer: Any) -> None:
    """The fitted model, its tokenizer (a VLM's processor with it) and the recipe."""
    if cfg.num_experts:  # written as a plain model: a forward returns no router logits
        model.config.output_router_logits = False
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    if cfg.model is None:
        model.save_pretrained(cfg.output_dir)
        if vision.processor_of(tokenizer) is not None:
            tokenizer.save_pretrained(cfg.output_dir)  # the processor with it
        else:
            save_tokenizer(tokenizer, cfg.output_dir)
    else:  # LoRA adapters merged in (and kept alone in adapter/)
        save_final(model, tokenizer, cfg.output_dir)
    # Provenance: the exact configuration that produced these weights.
    skip = {"output_dir", "overwrite", "progress"}
    recipe = {k: v for k, v in asdict(cfg).items() if k not in skip}
    (cfg.output_dir / "sft_config.json").write_text(json.dumps(recipe, indent=2) + "\n")
