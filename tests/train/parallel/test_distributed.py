"""torchrun scale-out on 2 CPU processes (gloo): the update equals the single-process update of
the same global batch, the real CLI trains, resumes and fails cleanly, FSDP checkpoints round-trip.

Each torchrun launch pays a few seconds of imports per process, so the parity checks all run in
one launch (`dist_worker.py`) and the CLI tests share their run where they can.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from numerics import F64_SAME

WORKER = Path(__file__).with_name("dist_worker.py")
CASES = ["grpo-ddp", "grpo-fsdp", "gspo-ddp", "gspo-fsdp", "dapo-ddp", "dapo-fsdp",
         "grpo-ddp-lora", "gspo-ddp-lora", "dapo-fsdp-micro3", "gdpo-ddp",
         "grpo-ddp-token_tis", "gspo-fsdp-icepop", "reinforce_pp-ddp-top_entropy_quantile",
         "gspo-fsdp-entropy_coef-entropy_target", "dapo-fsdp-packing-max_tokens_per_micro_batch",
         "gspo-ddp-lora-packing"]  # fmt: skip


def torchrun(*args, cwd, timeout=600, env=None):
    """A 2-process launch; `timeout` is a backstop for a hang (a launch takes well under a
    minute on 2 idle cores), far below the 30 minutes a rank waits in a collective."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *map(str, args)]  # fmt: skip
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    done = torchrun(WORKER, tmp / "out.json", tmp / "run", cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.numerics
@pytest.mark.parametrize("case", CASES)
def test_two_processes_update_like_one(parity, case):
    """Same global batch, ranks skipping different numbers of zero-advantage groups (rank 0
    three of its four, rank 1 none): the summed gradient at step 1 and the parameters after 3
    steps equal the single process's, and so do the logged diagnostics."""
    assert parity["world_size"] == 2
    result = parity[case]
    assert result["dtype"] == "torch.float64"  # the same computation: tests/numerics.py
    assert result["moved"] > 1e-4  # the updates did something
    assert result["grad_rel"] < F64_SAME
    assert result["weights_rel"] < F64_SAME
    # 3 of 8 groups skipped, globally; none where a constant group still has a gradient
    # (REINFORCE++'s batch whitening moves it, an entropy bonus acts on every token)
    dense = case.startswith("reinforce_pp") or "entropy_coef" in case
    assert result["trained_frac"] == ([1.0, 1.0] if dense else [0.625, 0.625])
    for key, (two, one) in result["diagnostics"].items():  # means of O(1) terms: absolute too
        assert two == pytest.approx(one, rel=F64_SAME, abs=F64_SAME), key


@pytest.mark.numerics
@pytest.mark.parametrize("case", ["tools-ddp", "tools-fsdp", "env-ddp", "env-fsdp"])
def test_two_processes_update_like_one_with_tools_and_environments(parity, case):
    """A batch whose completions hold tool observations (not trained), from the lookup tool
    or the vault environment: the same update on 2 processes as on 1."""
    result = parity[case]
    assert result["moved"] > 1e-4
    assert result["grad_rel"] < F64_SAME and result["weights_rel"] < F64_SAME


@pytest.mark.numerics
def test_fsdp_ranks_sample_with_tools_in_lockstep_as_one_process_does(parity):
    """Observations fed in chunks of each rank's own widths: the ranks still run the same
    forwards, and each samples what it would alone (float64: the same computation)."""
    result = parity["fsdp_tool_sampling"]
    assert result["fed_tokens_by_rank"][0] > 0 and result["fed_tokens_by_rank"][1] == 0
    assert result["mismatched_ranks"] == 0


def test_environment_groups_start_as_in_one_process(parity):
    """Each rank resets its groups' environments from the row's seed: every prompt's secret
    is the single-process one, and the G rollouts of a prompt share it."""
    assert parity["env_states_equal_single_process"] and parity["env_groups_share_state"]


def test_ranks_share_the_single_process_prompts_with_their_own_seeds(parity):
    assert parity["prompts_equal_single_process"] == [True, True]
    assert parity["same_prompt_on_both_ranks"] and parity["completions_differ"]


def test_dynamic_sampling_hands_kept_groups_round_evenly(parity):
    for step in parity["dynamic_sampling"]:
        two, one = step["per_rank"]
        assert two == one and step["groups"] == two + one > 0
        assert step["distinct"] and step["all_mixed"]


def test_fsdp_checkpoint_resumes_to_the_same_state(parity):
    result = parity["fsdp_checkpoint"]
    assert result["moved"] > 1e-4
    assert result["weights"] == 0.0 and result["moments"] == 0.0
    assert result["optimizer_entries"][0] == result["optimizer_entries"][1] > 0


TRAIN = ["-m", "grouprl", "train", "--threads", "1", "--prompts-per-step", "8",
         "--group-size", "4", "--eval-size", "8", "--eval-samples", "2"]  # fmt: skip


def test_torchrun_cli_trains_resumes_and_counts_the_global_batch(tmp_path):
    done = torchrun(*TRAIN, "--steps", "3", "--output-dir", "run", "--log-ratios", "6",
                    "--log-ratios-every", "1", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # one run directory
    assert done.stderr.count("run directory:") == 1  # rank 0 alone prints
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert all(r["groups"] == 8 for r in lines)  # the global batch, not a rank's half
    assert all(r["trained_frac"] <= 1 for r in lines)
    config = (tmp_path / "run/config.yaml").read_text()
    assert "strategy: ddp" in config
    assert (tmp_path / "run/final/model.safetensors").is_file()

    # the checkpoint is a full model directory: FSDP continues what DDP saved
    done = torchrun(*TRAIN, "--resume", "run", "--steps", "4", "--strategy", "fsdp", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming run from step 3" in done.stderr
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    # the ratio probe: 3 completions from each rank, gathered (under ddp, then fsdp)
    ratios = [json.loads(x) for x in (tmp_path / "run/ratios.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ratios] == [1, 2, 3, 4]
    assert all(len(r["lengths"]) == len(r["log_ratio_sum"]) == 6 for r in ratios)
    assert "strategy: fsdp" in (tmp_path / "run/config.yaml").read_text()
    assert (tmp_path / "run/checkpoints/step_000004/model.safetensors").is_file()


def test_a_reward_that_raises_on_one_rank_ends_both(tmp_path):
    (tmp_path / "rewards.py").write_text(
        "import os\n\n\n"
        "def picky(completions, **kwargs):\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ValueError('rank one cannot score this')\n"
        "    return [0.0] * len(completions)\n"
    )
    # a rank left waiting in a collective would wait its TIMEOUT (30 min): the launch's
    # backstop (`torchrun`) fails the test long before
    done = torchrun(*TRAIN, "--steps", "3", "--output-dir", "run", "--rewards", "correct", "1",
                    "rewards.py:picky", "0", cwd=tmp_path)  # fmt: skip
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "grouprl train: error:" in line]
    assert len(errors) == 1, done.stderr[-3000:]  # rank 0 alone prints the one line
    assert "rank one cannot score this" in errors[0] and "on rank 1" in errors[0]
    assert (tmp_path / "run/checkpoints/step_000000/manifest.json").is_file()


def test_a_write_that_fails_on_rank_0_ends_every_rank_with_one_line(tmp_path):
    """A full disk while rank 0 writes a checkpoint: every rank leaves at the same point (no
    rank waits in a collective until torchrun's timeout), rank 0 prints the one line, and the
    last complete checkpoint is intact. (Every write of rank 0 goes through the same agreement,
    `Dist.on_main`; test_reliability.py fails a log line and a checkpoint in one process.)"""
    spec = "checkpoint:2:ENOSPC"
    env = {"GROUPRL_FAULT": spec}  # only rank 0 writes, so only rank 0 reaches these points
    done = torchrun(*TRAIN, "--steps", "3", "--save-every", "1", "--output-dir", "run",
                    cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "grouprl train: error:" in line]
    assert len(errors) == 1 and "cannot write" in errors[0], done.stderr[-3000:]
    kept = tmp_path / "run/checkpoints" / ("step_000000" if "checkpoint" in spec else "step_000001")
    assert (kept / "manifest.json").is_file()


def test_every_rank_identifies_live_objects_alike(tmp_path):
    """A run from Python records what identifies its live objects; under torchrun every rank
    must compute the same (a partial bound to an object, whose repr holds its address, too)."""
    done = torchrun(Path(__file__).with_name("identity_worker.py"), tmp_path / "ids.json",
                    cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads((tmp_path / "ids.json").read_text())
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    assert " at 0x" not in ranks[0]["partial"] and "source sha256:" in ranks[0]["function"]
    assert (
        ranks[0]["model"].startswith("LlamaForCausalLM")
        and "parameters sha256:" in ranks[0]["model"]
    )


def test_a_two_process_async_run_equals_its_sequential_simulation(tmp_path):
    """--max-staleness 1 under torchrun: each rank's sampler thread samples its share on a
    process group of its own (its collectives never meet the trainer's), on the same fixed
    schedule as the run that samples in the trainer's thread."""
    from safetensors.torch import load_file

    args = [*TRAIN, "--steps", "3", "--max-staleness", "1", "--sampler-threads", "1",
            "--eval-every", "0", "--log-ratios", "0"]  # fmt: skip
    done = torchrun(*args, "--output-dir", "overlapped", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    done = torchrun(*args, "--output-dir", "sequential", cwd=tmp_path,
                    env={"GROUPRL_SEQUENTIAL_AHEAD": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    timing = {"step_seconds", "rollout_seconds", "tokens_per_s", "sampler_seconds",
              "update_seconds"}  # fmt: skip

    def metrics(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in timing} for x in lines]

    overlapped, sequential = metrics("overlapped"), metrics("sequential")
    assert overlapped == sequential
    assert [r["staleness"] for r in overlapped] == [0.0, 1.0, 1.0]
    assert all(r["groups"] == 8 for r in overlapped)  # the global batch
    a = load_file(str(tmp_path / "overlapped/final/model.safetensors"))
    b = load_file(str(tmp_path / "sequential/final/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
