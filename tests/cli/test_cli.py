"""The CLI end to end: a YAML config with flag overrides, plot, explain, and clear failures."""

import json

import yaml

from grouprl.cli import main


def test_yaml_config_then_flags_override_and_plot(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        "algo: grpo\nsteps: 1\nprompts_per_step: 2\ngroup_size: 2\nlr: 0.001\n"
        "eval_size: 2\neval_samples: 1\nthreads: 1\n"
    )
    run_dir = tmp_path / "run"
    code = main(["train", "--config", str(config), "--lr", "0.0003", "--output-dir", str(run_dir)])
    assert code == 0
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["algo"] == "grpo" and saved["steps"] == 1  # from the file
    assert saved["lr"] == 0.0003  # the flag wins
    assert saved["ratio_level"] == "token" and saved["clip_high"] == 0.2  # the grpo preset
    capsys.readouterr()

    (run_dir / "plots").rename(tmp_path / "old_plots")
    assert main(["plot", str(run_dir)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(run_dir / "plots" / "reward.png") in printed
    assert (run_dir / "plots" / "reward.png").stat().st_size > 1000


def test_plot_of_a_directory_without_a_run_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a grouprl run directory" in err[0]


def test_explain_json_carries_the_seed_numbers(capsys):
    assert main(["explain", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    first = data["advantages"]["groups"][0]
    assert first["rewards"] == [1.0, 0.0, 1.0, 0.0]
    assert first["advantages"] == [1.0, -1.0, 1.0, -1.0]
    assert data["clipping"]["token_ratios"] == [2.0, 0.5]
    assert data["clipping"]["sequence_ratio"] == 1.0


def test_unknown_command_and_missing_model(tmp_path, capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
    code = main(["train", "--model", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a local directory" in err[0]
    assert not (tmp_path / "r").exists()


def test_peft_datasets_and_math_verify_load_only_when_used():
    """A default run builds its task, rewards and policy without importing them: peft alone
    costs seconds to import, and every CLI call would pay it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from grouprl.config import TrainConfig\n"
        "from grouprl.train import build, loop, evaluate\n"
        "cfg = TrainConfig(beta=0.0, model='builtin:arith')\n"
        "task = build.build_task(cfg)\n"
        "rewards = build.build_rewards(cfg, task, 'cpu')\n"
        "build.load_policy(cfg, 'cpu')\n"
        "print(sorted(m for m in ('peft', 'datasets', 'math_verify') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
