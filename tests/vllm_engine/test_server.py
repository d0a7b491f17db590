"""Rollouts on vLLM servers (`--vllm-server`), against two real servers of vLLM's CPU build
started once for the session (`servers` in conftest; test_engine.py runs its sampling tests on
one too: greedy ids up to the first near tie, log-probs, seeds, ends, tool turns): a weight sync moves a server to the updated policy and its version; a run trains
and resumes through a server; an asynchronous run samples the versions of its schedule; two
servers each keep a group and both hold version k before any sample of step k + 1; TRL's script
in server mode trains against a running server."""

from __future__ import annotations

import copy
import json
import os
import runpy
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grouprl.config import TrainConfig
from grouprl.rollout import sample_groups
from grouprl.rollout.vllm_server import Server, VLLMServerEngine
from grouprl.train import loop
from numerics import F64_SAME, assert_greedy_agrees
from resumed_runs import straight_and_resumed

TEXTS = ["12+30=", "What is 7 plus 5?", "answer", "<think>add</think>", "1,200 dollars", "x"]
TIMES = {"step_seconds", "rollout_seconds", "tokens_per_s", "sampler_seconds", "update_seconds"}


def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def options(vllm_model_dir, files, servers, **extra):
    return dict(
        model=str(vllm_model_dir), vllm_server=servers, dataset=str(files / "sums.jsonl"),
        rewards={f"{files / 'rewards.py'}:length": 1.0}, max_new_tokens=16, steps=3,
        prompts_per_step=4, group_size=4, eval_size=4, eval_samples=2, eval_every=0,
        save_every=1, progress=False, threads=1, warmup_steps=0, lr=1e-3, seed=1, **extra,
    )  # fmt: skip


def test_a_weight_sync_moves_the_server_to_the_updated_policy(servers, model, tokenizer):
    """After an update and `policy_updated(1)`, the server's greedy ids are the updated
    policy's (and not the old one's), and it reports version 1; version 0's directory is gone."""
    policy = copy.deepcopy(model)
    engine = VLLMServerEngine(policy, tokenizer, servers[:1], weights=lambda: policy.state_dict())
    try:
        ids = prompts(tokenizer)
        old = engine.sample(ids, group_size=1, max_new_tokens=12, temperature=0.0)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        engine.policy_updated(1)
        new = engine.sample(ids, group_size=1, max_new_tokens=12, temperature=0.0)
        hf = sample_groups(policy, tokenizer, ids, group_size=1, max_new_tokens=12,
                           temperature=0.0)  # fmt: skip
        assert_greedy_agrees(policy, ids, hf, new)
        assert new.completion_id_lists() != old.completion_id_lists()
        assert Server(servers[0]).get("/weight_info")["weight_version"] == "1"
        assert [p.name for p in engine.weights_dir.iterdir()] == ["version-1"]
        assert (engine.synced, engine.syncs) == (1, 2)
    finally:
        engine.close()
    assert not engine.weights_dir.exists()  # a temporary directory goes with the engine


@pytest.fixture(scope="module")
def runs(servers, vllm_model_dir, files, tmp_path_factory):
    """A straight 3-step run through one server, and one stopped during step 2 and resumed."""
    settings = options(vllm_model_dir, files, servers[0], log_ratios=4, log_ratios_every=1)
    straight, broken, resumed = straight_and_resumed(settings, tmp_path_factory.mktemp("server"))
    return straight, broken, resumed


def test_a_run_through_a_server_trains_and_resumes_as_the_straight_one(runs):
    """The resumed run re-syncs the server to the checkpoint's version before it samples, and
    equals the straight run: the same completions, metrics, samples and final weights."""
    straight, broken, resumed = runs
    assert straight.steps_done == 3 and broken.interrupted and resumed.steps_done == 3
    records = metrics(straight.run_dir)
    assert records[-1]["grad_norm"] > 0 and all("logp_mismatch_max" in r for r in records)
    assert all(r["logp_mismatch_max"] < 1e-4 for r in records)  # fp32 server: rounding only

    def comparable(run_dir):
        return [{k: v for k, v in r.items() if k not in TIMES} for r in metrics(run_dir)]

    assert comparable(resumed.run_dir) == comparable(straight.run_dir)
    last = [(r.run_dir / "samples.jsonl").read_text().splitlines()[-1] for r in (straight, resumed)]
    assert last[0] == last[1]
    a = load_file(str(straight.run_dir / "final" / "model.safetensors"))
    b = load_file(str(resumed.run_dir / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_async_lora_run_samples_the_versions_of_its_schedule(
    servers, vllm_model_dir, files, tmp_path
):
    """--max-staleness 1 with a server, LoRA: batch k is sampled by version max(0, k − 1) (the
    adapters merged), which the server holds when it samples it (any other version's answer
    would stop the run)."""
    settings = {**options(vllm_model_dir, files, servers[0], max_staleness=1), "lora_r": 4,
                "lr": 1e-2}  # fmt: skip
    result = loop.train(TrainConfig(**settings, output_dir=tmp_path / "async"))
    assert result.steps_done == 3
    records = metrics(result.run_dir)
    assert [r["staleness"] for r in records] == [0.0, 1.0, 1.0]
    # batch 0 is sampled by the trainer's own weights: rounding only; later ones by the version
    # before, a lag the mismatch then measures too
    assert records[0]["logp_mismatch_max"] < 1e-4 < records[2]["logp_mismatch_max"]
    assert Server(servers[0]).get("/weight_info")["weight_version"] == "1"  # batch 2's


def test_two_servers_each_keep_a_group_and_hold_version_k_before_step_k_plus_1(
    servers, vllm_model_dir, files, tmp_path, monkeypatch
):
    """Every call to either server is recorded in order: each prompt's requests go to one
    server, both servers sample, and each reports version k (its sync done) before any
    completion of step k + 1 is sampled on either."""
    events = []
    call = Server.call

    def recorded(self, method, path, body=None, **kwargs):
        answer = call(self, method, path, body, **kwargs)
        events.append((self.url, path, body, answer))
        return answer

    monkeypatch.setattr(Server, "call", recorded)
    settings = options(vllm_model_dir, files, ",".join(servers))
    result = loop.train(TrainConfig(**settings, output_dir=tmp_path / "two"))
    assert result.steps_done == 3
    held = {url: None for url in servers}  # each server's version, as it reported it
    owner, versions_sampled = {}, set()
    for url, path, body, answer in events:
        if path == "/weight_info":
            held[url] = answer["weight_version"]
        elif path == "/inference/v1/generate" and body["sampling_params"]["max_tokens"] > 1:
            (version,) = {s["version"] for c in answer["choices"] for s in c["weight_versions"]}
            assert all(held[u] == version for u in servers), (held, version)  # both synced
            prompt = tuple(body["token_ids"])[:4], version
            assert owner.setdefault(prompt, url) == url  # a prompt's requests: one server
            versions_sampled.add(version)
    assert set(owner.values()) == set(servers)  # both servers sampled
    assert versions_sampled == {"0", "1", "2", "3"}  # 3 steps, then the final evaluation


SCRIPTS = Path(__file__).resolve().parents[1] / "trl_shim"


def test_trls_grpo_script_in_server_mode_trains_against_a_running_server(
    servers, vllm_model_dir, tmp_path, monkeypatch
):
    """TRL's own trl/scripts/grpo.py (import changed) with --use_vllm --vllm_mode server
    --vllm_server_base_url URL: the server the script names samples every step."""
    pytest.importorskip("trl")
    import yaml
    from tests.trl_shim.trl_scripts import dataset_dir, trl_grpo_script

    dataset_dir(tmp_path / "sums", {"train": 64, "test": 8})
    script = trl_grpo_script(tmp_path)
    (tmp_path / "spread.py").write_text(
        "def length(completions, **kwargs):\n"
        "    return [len(c[0]['content']) / 40 for c in completions]\n"
    )
    argv = ["--model_name_or_path", str(vllm_model_dir), "--dataset_name", "sums",
            "--reward_funcs", "accuracy_reward", "spread.length", "--max_steps", "2",
            "--max_completion_length", "12", "--per_device_train_batch_size", "4",
            "--num_generations", "4", "--use_vllm", "--vllm_mode", "server",
            "--vllm_server_base_url", servers[1], "--bf16", "false"]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo.py", *argv])
    runpy.run_path(str(script), run_name="__main__")
    run = tmp_path / "trainer_output"
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert (record["engine"], record["vllm_server"]) == ("vllm", servers[1])
    steps = metrics(run)
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["logp_mismatch_max"] < 1e-3 for m in steps)
    assert Server(servers[1]).get("/weight_info")["weight_version"] in ("1", "2")


WORKER = Path(__file__).with_name("scripts") / "server_worker.py"


def torchrun(*args, cwd):
    """A 2-process launch (gloo); the timeout is a backstop for a hang."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *map(str, args)]  # fmt: skip
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_two_ranks_sample_through_the_servers_and_update_like_one(
    servers, vllm_model_dir, tmp_path
):
    """torchrun, 2 gloo ranks: each samples its share through both servers (rank 0 syncs, rank
    1 waits for the version), and 3 updates on the gathered batch equal one process's; then
    version 3 reaches both servers and both ranks sample it."""
    out = tmp_path / "out.json"
    done = torchrun(WORKER, vllm_model_dir, ",".join(servers), out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rows"] == 16 and result["tokens"] > 16
    assert result["moved"] > 1e-4  # the updates did something
    assert result["grad_diff"] / result["grad_scale"] < F64_SAME
    assert result["weight_diff"] / result["weight_scale"] < F64_SAME
    assert (result["synced"], result["servers"], result["syncs"]) == (3, ["3", "3"], 2)
    assert result["again_rows"] == 4


def test_torchrun_cli_trains_three_steps_through_the_servers(servers, vllm_model_dir, files,
                                                             tmp_path):  # fmt: skip
    done = torchrun("-m", "grouprl", "train", "--model", vllm_model_dir, "--vllm-server",
                    ",".join(servers), "--dataset", files / "sums.jsonl", "--rewards",
                    f"{files / 'rewards.py'}:length", "1", "--max-new-tokens", "12", "--steps",
                    "3", "--prompts-per-step", "4", "--minibatches", "1", "--group-size", "4",
                    "--eval-every", "0",
                    "--eval-size", "4", "--threads", "1", "--output-dir", "run", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["groups"] == 4 and r["logp_mismatch_max"] < 1e-4 for r in records)
    assert [Server(u).get("/weight_info")["weight_version"] for u in servers] == ["3", "3"]


def test_a_judge_asks_a_vllm_server(servers, vllm_model_dir, tmp_path):
    """An LLM judge (`--rewards judge.yaml`) against a vLLM server's chat route: every call is
    answered (the random model's answers rarely parse: those scores are None, counted, never
    0), and a second call is answered from the cache."""
    from grouprl.tasks.rewards.judge import load_judge

    settings = {"url": f"{servers[0]}/v1", "model": str(vllm_model_dir), "template":
                "Q: {prompt}\nA: {completion}\nScore 0-9.", "scale": [0, 9], "max_tokens": 8,
                "timeout": 60}  # fmt: skip
    (tmp_path / "judge.yaml").write_text(json.dumps({"judge": settings}))
    judge = load_judge(str(tmp_path / "judge.yaml"))
    judge.check()
    extra, logged = {}, {}
    kw = dict(prompts=["1+1?", "2+2?", "3+3?"], log_extra=extra.__setitem__,
              log_metric=logged.__setitem__)  # fmt: skip
    scores = judge(["2", "4", "6"], **kw)
    assert all(isinstance(a, str) for a in extra["judge_answer"])  # answered, every one
    assert logged["judge_unscored"] == sum(s is None for s in scores) / 3
    assert all(s is None or 0 <= s <= 1 for s in scores)
    calls = judge.calls
    assert judge(["2", "4", "6"], **kw) == scores and judge.calls == calls  # from the cache
