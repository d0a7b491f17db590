"""vLLM in a process of its own: `VLLMProcessEngine`, the `RolloutEngine` an asynchronous run
samples with when `--engine vllm` (TRL's `vllm_mode="server"` has the same shape: an engine
beside the trainer, weights pushed to it with a version after each optimizer step).

The child runs `VLLMEngine` (everything it does, contained there: vLLM's global state, its
environment changes, its thread count, its NUMA binding) over a skeleton of the policy (its
config and generation config on the meta device: no weights are ever loaded from disk). Requests
and rollouts cross a pipe; weights cross as a safetensors file per version in a private
temporary directory (vLLM's own weight-transfer backends are GPU-only, and on a CPU a file in
the page cache is one copy), written only when the version changed since the child's last load.
The child is started with `spawn` (a fork would copy the trainer's threads and locks) and ended
by `close()`, or by the trainer's exit (it is a daemon, and it also ends when its pipe closes).
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from grouprl.errors import UserError
from grouprl.rollout.types import Rollout

#: Seconds the child may take to start vLLM (it loads vLLM, builds dummy weights and profiles).
START_TIMEOUT = 600


class VLLMProcessEngine:
    """`RolloutEngine.sample` by a `VLLMEngine` in a child process over `weights()` (the
    tensors by checkpoint name, as `VLLMEngine` takes them), loaded after each
    `policy_updated(version)` before the next sample. No tools: a tool call is answered in the
    trainer's process, which this engine does not reach into."""

    def __init__(
        self,
        policy: nn.Module,
        tokenizer: Any,
        options: Any,
        *,
        weights: Callable[[], dict[str, torch.Tensor]],
    ) -> None:
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        self.device = next(policy.parameters()).device
        self.weights, self.tools = weights, None
        self.version: int | None = None  # the version last announced
        self.synced: int | None = None  # the version the child holds
        self.loaded = False  # whether the child holds any weights yet
        self._directory = Path(tempfile.mkdtemp(prefix="grouprl-vllm-weights-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._directory, True)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        spec = (type(base).__name__, base.config, base.generation_config, tokenizer, options)
        self._process = context.Process(target=_serve, args=(child, spec), daemon=True,
                                        name="grouprl-vllm")  # fmt: skip
        self._process.start()
        child.close()
        self._call(None, timeout=START_TIMEOUT)  # the child's "ready", or its error

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
        tools: Any = None,
    ) -> Rollout:
        """`RolloutEngine.sample` in the child, after the version announced last is loaded."""
        if tools is not None:
            raise UserError(
                "vLLM in its own process (an asynchronous run with --engine vllm) answers no "
                "tool calls yet; use --engine hf for tools and environments"
            )
        if not self.loaded or self.synced != self.version:
            path = self._directory / f"weights-{self.version}.safetensors"
            save_file(_host_tensors(self.weights()), str(path))
            self._call(("weights", str(path), self.version))
            for old in self._directory.glob("weights-*.safetensors"):
                if old != path:
                    old.unlink()
            self.synced, self.loaded = self.version, True
        kwargs = dict(group_size=group_size, max_new_tokens=max_new_tokens,
                      temperature=temperature, top_p=top_p, top_k=top_k,
                      stop=None if stop is None else list(stop), seed=seed)  # fmt: skip
        rollout = self._call(("sample", [list(p) for p in prompts], kwargs))
        return rollout.to(self.device)

    def policy_updated(self, version: int) -> None:
        """The weights `weights()` returns are version `version` now: loaded before the next
        sample."""
        self.version = version

    def close(self) -> None:
        """End the child (it frees vLLM) and remove the weight files."""
        if self._process.is_alive():
            try:
                self._conn.send(("close",))
                self._process.join(timeout=60)
            except (BrokenPipeError, EOFError, OSError):
                pass
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=10)
        self._conn.close()
        self._finalizer()

    def _call(self, message: Any, timeout: float | None = None) -> Any:
        """Send `message` (None: send nothing) and return the child's answer, raising its error
        here (a UserError as it is, anything else naming the child)."""
        if message is not None:
            self._conn.send(message)
        if timeout is not None and not self._conn.poll(timeout):
            raise UserError(f"vLLM's process did not start within {timeout} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            code = self._process.exitcode
            raise UserError(
                f"vLLM's process ended (exit code {code}); see its output above"
            ) from None
        if kind == "error":
            raise value
        return value


def _host_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` as a file another process reads takes them: on the host, whatever the policy's
    device, and none sharing memory with another (safetensors refuses tied embeddings: the
    second name gets a copy)."""
    tensors, storages = {}, set()
    for name, value in weights.items():
        tensor = value.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
    return tensors


def _serve(conn: Any, spec: tuple) -> None:
    """The child: a `VLLMEngine` over the policy's skeleton, answering the parent's messages
    until it says close or its pipe ends."""
    from transformers import AutoModelForCausalLM

    from grouprl.rollout.vllm_engine import VLLMEngine

    name, config, generation, tokenizer, options = spec
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        if type(skeleton).__name__ != name:
            raise UserError(f"vLLM's process rebuilt {type(skeleton).__name__}, not {name}")
        if generation is not None:
            skeleton.generation_config = generation
        current: dict[str, str] = {}
        # rollouts stay on the host here: they cross the pipe, and the parent moves them to
        # the policy's device (CUDA or not); vLLM itself runs where `options` say
        engine = VLLMEngine(skeleton, tokenizer, options, device=torch.device("cpu"),
                            weights=lambda: load_file(current["path"]))  # fmt: skip
        conn.send(("ok", None))
    except BaseException as err:
        conn.send(("error", _portable(err)))
        return
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            try:
                if message[0] == "close":
                    return
                if message[0] == "weights":
                    current["path"] = message[1]
                    engine.policy_updated(message[2])
                    conn.send(("ok", None))
                elif message[0] == "sample":
                    conn.send(("ok", engine.sample(message[1], **message[2])))
            except BaseException as err:
                conn.send(("error", _portable(err)))
    finally:
        engine.close()


def _portable(err: BaseException) -> BaseException:
    """`err` if it crosses a pipe (a UserError always does), else a RuntimeError naming it."""
    if isinstance(err, UserError):
        return UserError(str(err))
    return RuntimeError(f"in vLLM's process: {type(err).__name__}: {err}")
