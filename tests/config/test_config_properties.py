"""Property-based tests of config parsing: whatever a YAML file or a command line holds, the
result is a valid config or one UserError line, never a traceback."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grouprl.config import TrainConfig, field_names, from_mapping, parse_train_args, resolve
from grouprl.errors import UserError

FIELDS = [n for n in field_names() if n not in ("config", "resume", "output_dir")]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["grpo", "gspo", "dapo", "bf16", "fp32", "token", "1e-4", "3.0", "-1", ""]),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.dictionaries(st.text(max_size=6), scalars, max_size=2),
)
keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=10))


def _valid_or_one_line(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = make()
            return resolve(cfg, task_max_new_tokens=40)
        except UserError as err:
            message = str(err)
            assert message and "\n" not in message, repr(message)
            return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, values, max_size=4))
def test_any_yaml_mapping_gives_a_config_or_one_line(mapping):
    cfg = _valid_or_one_line(lambda: from_mapping(mapping, source="run.yaml"))
    assert cfg is None or isinstance(cfg, TrainConfig)


flags = st.sampled_from(["--" + n.replace("_", "-") for n in FIELDS] + ["--no-progress", "--x"])
tokens = st.one_of(flags, st.text(max_size=8).filter(lambda t: t not in ("-h", "--help")))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tokens, max_size=6))
def test_any_command_line_gives_a_config_or_one_line(argv):
    cfg = _valid_or_one_line(lambda: parse_train_args(argv))
    assert cfg is None or isinstance(cfg, TrainConfig)


@pytest.mark.parametrize("argv", [["--steps"], ["--rewards", "a"], ["-x"], ["--lr", "nan"]])
def test_examples_that_once_escaped(argv):
    _valid_or_one_line(lambda: parse_train_args(argv))
