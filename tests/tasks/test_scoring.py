"""Reward functions by name (built-in, file, module, reward model), TRL's calling convention,
the pass reward, time limits that nest, and concurrent async rewards."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import pytest
import torch

from grouprl.errors import UserError
from grouprl.tasks import get_task
from grouprl.tasks.base import TimeLimitExceeded, TrainerState, call_rewards, time_limit
from grouprl.tasks.rewards.math import accuracy
from grouprl.tasks.rewards.scoring import (
    build_reward_set,
    load_reward,
    required_columns,
)
from numerics import F64_SAME, U32, to_float64

ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
REWARD_FILE = """
import asyncio

def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def logs(completions, trainer_state, log_metric, log_extra, completion_ids, **kwargs):
    log_metric("calls", 1.0)
    log_extra("step", [trainer_state.global_step] * len(completions))
    return [float(len(ids)) for ids in completion_ids]

async def slow_half(completions, **kwargs):
    await asyncio.sleep(0)
    return [0.5] * len(completions)

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return path


def burn(seconds: float) -> None:
    """Busy work for a bounded time (a hang that a broken time limit cannot turn into a hung
    suite); `except Exception` inside must not swallow a time limit."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with contextlib.suppress(Exception):
            sum(range(1000))


def test_names_resolve_to_builtin_file_and_module_functions(reward_file):
    task = get_task("arithmetic")
    assert load_reward("correct", task)[0] == "correct"
    assert load_reward("accuracy", None)[1] is accuracy
    name, fn = load_reward(f"{reward_file}:exact")
    assert name == "exact" and fn(["2"], answer=["2"]) == [1.0]
    name, fn = load_reward("grouprl.tasks.rewards.math:think_format")
    assert name == "think_format"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("acuracy", r"unknown reward 'acuracy'; did you mean 'accuracy'\?"),
        ("{file}:nope", r"has no function 'nope'; functions found: .*exact"),
        ("{file}:NOT_A_FUNCTION", r"is a int, not a function"),
        ("{dir}/missing.py:fn", r"reward file .*missing.py does not exist"),
        ("no_such_module_xyz:fn", r"cannot import module 'no_such_module_xyz'"),
        ("{dir}", r"is a directory without config.json, not a reward model"),
    ],
)
def test_bad_reward_names_are_one_line(reward_file, spec, message):
    spec = spec.format(file=reward_file, dir=reward_file.parent)
    with pytest.raises(UserError, match=message):
        load_reward(spec)


def test_a_reward_file_that_fails_to_import_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import not_a_module_anywhere\n")
    with pytest.raises(UserError, match=r"importing reward file .*bad.py raised ModuleNotFound"):
        load_reward(f"{bad}:fn")


def test_score_weights_nan_and_the_pass_reward(reward_file):
    def first(completions, prompts, answer, **kwargs):
        return [1.0, None, 0.0, None]

    def second(completions, **kwargs):
        return [0.5, None, None, 1]

    def logged_only(completions, **kwargs):
        return [0.0] * len(completions)

    funcs = {"first": first, "second": second, "logged_only": logged_only}
    rewards = build_reward_set(
        {"first": 1.0, "second": 2.0, "logged_only": 0.0},
        None,
        pass_reward="first",
        loader=lambda spec, task, device: (spec, funcs[spec]),
    )
    scores = rewards.score(
        ["a", "b", "c", "d"], ROWS, 2, completion_ids=[[1]] * 4, state=TrainerState()
    )
    assert scores.total[0] == 2.0 and scores.total[2] == 0.0 and scores.total[3] == 2.0
    # row 1: only the weight-0 function scored it, which does not make it scored
    assert math.isnan(scores.total[1])
    assert torch.isnan(scores.by_function["first"]).tolist() == [False, True, False, True]
    assert scores.passed.tolist() == [True, False, False, False]


def test_trl_keyword_arguments_reach_the_function(reward_file):
    rewards = build_reward_set({f"{reward_file}:logs": 1.0}, None)
    scores = rewards.score(
        ["a", "b", "c", "d"],
        ROWS,
        2,
        completion_ids=[[1], [1, 2], [3], [4, 5, 6]],
        state=TrainerState(global_step=7, max_steps=9),
    )
    assert scores.by_function["logs"].tolist() == [1.0, 2.0, 1.0, 3.0]
    assert scores.logged == {"calls": 1.0}
    assert scores.extra == {"step": [7, 7, 7, 7]}


def test_conversational_prompts_get_message_completions():
    seen = {}

    def spy(completions, prompts, **kwargs):
        seen.update(completions=completions, prompts=prompts)
        return [0.0] * len(completions)

    chat_rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}]
    rewards = build_reward_set({"spy": 1.0}, None, loader=lambda s, t, device: (s, spy))
    rewards.score(["yo", "hey"], chat_rows, 2, completion_ids=[[1], [1]], state=TrainerState())
    assert seen["completions"] == [
        [{"role": "assistant", "content": "yo"}],
        [{"role": "assistant", "content": "hey"}],
    ]
    assert seen["prompts"] == [chat_rows[0]["prompt"]] * 2


def test_the_default_pass_reward_is_accuracy_then_correct_then_the_first(reward_file):
    def pick(weights, **kw):
        return build_reward_set(weights, get_task("arithmetic"), **kw).pass_reward

    assert pick({"format": 0.1, "accuracy": 1.0, "correct": 1.0}) == "accuracy"
    assert pick({"format": 0.1, "correct": 1.0}) == "correct"
    assert pick({f"{reward_file}:exact": 1.0, "format": 0.1}) == "exact"
    # a pass reward that is not listed is added with weight 0: logged, not in the total
    rewards = build_reward_set({"format": 1.0}, get_task("arithmetic"), pass_reward="correct")
    assert rewards.pass_reward == "correct" and rewards.weights == {"format": 1.0, "correct": 0.0}


def test_required_columns_come_from_the_signature(reward_file):
    _, exact = load_reward(f"{reward_file}:exact")
    assert required_columns(exact) == ["answer"]
    assert required_columns(accuracy) == ["answer"]
    assert required_columns(lambda completions, prompts, **kw: []) == []
    rewards = build_reward_set({f"{reward_file}:exact": 1.0}, None)
    with pytest.raises(UserError, match=r"needs a column 'answer'.*--answer-column"):
        rewards.check_columns({"prompt": "p", "solution": "2"}, "my data")


def test_async_rewards_run_concurrently():
    """Each of these waits for the other: run one after the other they could never finish."""
    ready = {}

    async def ping(completions, **kwargs):
        ready.setdefault("ping", asyncio.Event()).set()
        await ready.setdefault("pong", asyncio.Event()).wait()
        return [1.0] * len(completions)

    async def pong(completions, **kwargs):
        ready.setdefault("pong", asyncio.Event()).set()
        await ready.setdefault("ping", asyncio.Event()).wait()
        return [0.0] * len(completions)

    kwargs = {"completions": ["a", "b"], "prompts": ["p", "p"]}
    out = call_rewards({"ping": ping, "pong": pong}, kwargs, timeout=20)
    assert out == {"ping": [1.0, 1.0], "pong": [0.0, 0.0]}


def test_a_hanging_async_reward_times_out_naming_it():
    async def hang(completions, **kwargs):
        burn(30)
        return [0.0] * len(completions)

    with pytest.raises(UserError, match=r"reward function 'hang' did not return within 0\.2 s"):
        call_rewards({"hang": hang}, {"completions": ["a"], "prompts": ["p"]}, timeout=0.2)


def test_time_limits_nest():
    with pytest.raises(TimeLimitExceeded), time_limit(5):  # the inner limit ends the inner body
        with time_limit(0.1):
            burn(30)
        pytest.fail("unreachable")  # pragma: no cover
    outer = None
    try:
        with time_limit(0.2):
            try:
                with time_limit(10):  # the outer limit runs out first and ends both
                    burn(30)
            except TimeLimitExceeded:  # pragma: no cover - the inner one must not fire
                pytest.fail("the inner limit fired")
    except TimeLimitExceeded as err:
        outer = err
    assert outer is not None


def test_a_hanging_reward_after_accuracy_still_times_out():
    """math-verify's own signal timeouts would cancel the reward deadline; they are off, and
    accuracy's per-completion limits nest inside the deadline."""

    def hang(completions, **kwargs):
        burn(30)
        return [0.0] * len(completions)

    kwargs = {"completions": ["\\boxed{4}", "#### 5"], "prompts": ["p", "p"], "answer": ["4", "4"]}
    accuracy(["0"], answer=["0"])  # math-verify imported before the clock starts
    # accuracy on two short answers takes milliseconds: a deadline of 2 s leaves it room on a
    # loaded machine, so only `hang` can be the one named
    with pytest.raises(UserError, match=r"'hang' did not return within 2 s"):
        call_rewards({"accuracy": accuracy, "hang": hang}, kwargs, timeout=2.0)
    assert call_rewards({"accuracy": accuracy}, kwargs, timeout=5) == {"accuracy": [1.0, 0.0]}


@pytest.mark.numerics
def test_a_reward_model_directory_scores_prompt_and_completion(tmp_path):
    """A sequence-classification model given as a reward name: its first logit on prompt +
    completion (the chat template's rendering for conversational data), as TRL scores."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grouprl.models import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    name, rm = load_reward(str(tmp_path / "rm"))
    assert name == "rm"
    # The reward model scores a padded batch; the reference, each text alone: the same
    # computation over other shapes, so compared in float64 (tests/numerics.py). RewardModel
    # returns float32 scores: one rounding, u·|score|, on top.
    to_float64(rm.model)
    model = to_float64(LlamaForSequenceClassification.from_pretrained(tmp_path / "rm")).eval()

    def first_logit(text):
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            return float(model(**ids).logits[0, 0])

    def close(got, want):
        return got == pytest.approx(want, rel=U32 + F64_SAME, abs=0)

    scores = rm(completions=["12", "345"], prompts=["1+", "2+"])
    assert close(scores, [first_logit("1+12"), first_logit("2+345")])
    assert scores[0] != pytest.approx(scores[1])
    chat = [{"role": "user", "content": "1+"}]
    (score,) = rm(completions=[[{"role": "assistant", "content": "12"}]], prompts=[chat])
    assert close(score, first_logit("user: 1+\nassistant: 12\n"))


def test_limits_that_run_out_as_their_body_ends_never_leak():
    """Thousands of limits whose bodies end right around their deadline: each either finishes
    or raises TimeLimitExceeded (never the alarm's internal exception), an outer limit is never
    swallowed by an inner one's handler, and afterwards no limit is left and SIGALRM has its
    handler back."""
    import signal

    from grouprl.tasks import base

    before = signal.getsignal(signal.SIGALRM)
    outcomes = {"done": 0, "timed out": 0}
    for i in range(3000):
        seconds = 3e-4
        try:
            with time_limit(seconds):
                burn(seconds * (0.5 + (i % 10) / 10))  # 0.5x to 1.4x the limit
            outcomes["done"] += 1
        except TimeLimitExceeded:
            outcomes["timed out"] += 1
    assert outcomes["done"] > 0 and outcomes["timed out"] > 0
    outer_expired = 0
    for i in range(300):
        try:
            with time_limit(2e-3):
                for _ in range(50):
                    try:
                        with time_limit(1e-4 * (1 + i % 3)):
                            burn(1e-4)
                    except TimeLimitExceeded:
                        pass  # the inner limit's own expiry: swallowed on purpose
        except TimeLimitExceeded:
            outer_expired += 1
    assert outer_expired == 300  # every outer deadline ended its loop, none was swallowed
    assert base._LIMITS == [] and base._BUSY == 0
    assert signal.getsignal(signal.SIGALRM) == before


def test_async_rewards_that_wait_or_compute_forever_are_stopped():
    """One reward awaits something that never comes, the other computes without yielding: the
    event loop's timeout ends the first, the alarm the second; both are named."""

    async def waits(completions, **kwargs):
        await asyncio.Event().wait()

    async def computes(completions, **kwargs):
        burn(30)
        return [0.0] * len(completions)

    kwargs = {"completions": ["a"], "prompts": ["p"]}
    with time_limit(20):  # a guard: a broken timeout fails here instead of hanging
        with pytest.raises(UserError, match=r"'waits', 'computes' did not return within 0\.3 s"):
            call_rewards({"waits": waits, "computes": computes}, kwargs, timeout=0.3)
        with pytest.raises(UserError, match=r"reward function 'waits' did not return"):
            call_rewards({"waits": waits}, kwargs, timeout=0.3)
