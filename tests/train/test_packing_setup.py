"""Packing and token budgets as a user meets them: mistakes are one line before anything is
written; a model that cannot pack is refused under --packing on and runs padded otherwise."""

from __future__ import annotations

import pytest

from grouprl.cli import main
from grouprl.rollout import logprobs, packed


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--max-tokens-per-micro-batch", "100"],
         "--max-tokens-per-micro-batch 100 is smaller than the longest row this run can sample: "
         "218 prompt + 38 completion tokens, 255 forwarded; it must be at least 255"),
        (["--max-tokens-per-micro-batch", "300", "--micro-batch-size", "4"],
         "give --micro-batch-size (completions) or --max-tokens-per-micro-batch (tokens), not "
         "both"),
        (["--max-tokens-per-micro-batch", "0"], "max_tokens_per_micro_batch must be at least 1"),
        (["--packing", "sometimes"], "--packing"),
    ],
)  # fmt: skip
def test_a_budget_mistake_is_one_line_before_anything_is_written(tmp_path, capsys, flags, says):
    run = tmp_path / "run"
    code = main(["train", "--steps", "1", "--output-dir", str(run), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and says in err[-1], err
    assert not run.exists()


def test_a_model_that_cannot_pack_is_refused_when_forced_and_padded_otherwise(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(packed, "packs_rows", lambda model: False)
    run = tmp_path / "forced"
    code = main(["train", "--steps", "1", "--output-dir", str(run), "--packing", "on"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "use --packing auto or off" in err[0], err
    assert not run.exists()

    forwards = []
    original = logprobs.completion_logprobs

    def spy(model, batch, **kwargs):
        forwards.append(kwargs.get("packs"))
        return original(model, batch, **kwargs)

    from grouprl.train.parallel import fsdp

    monkeypatch.setattr(fsdp, "completion_logprobs", spy)
    code = main(["train", "--steps", "1", "--output-dir", str(tmp_path / "padded"),
                 "--max-tokens-per-micro-batch", "600", "--eval-every", "0"])  # fmt: skip
    err = " ".join(capsys.readouterr().err.split())  # the console wraps its lines
    assert code == 0 and "does not keep packed rows apart: its passes run padded" in err
    assert forwards and all(packs is None for packs in forwards)
