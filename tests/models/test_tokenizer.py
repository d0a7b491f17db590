"""The character tokenizer: exact round-trips, BOS on prompts, unknown characters, saving."""

from __future__ import annotations

import json
import random
import string

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from grouprl.models import build_char_tokenizer, save_tokenizer
from grouprl.models.tokenizer import DEFAULT_ALPHABET, SPECIAL_TOKENS
from grouprl.tasks import get_task


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


def test_special_tokens(tokenizer) -> None:
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert (tokenizer.pad_token, tokenizer.bos_token) == ("<pad>", "<bos>")
    assert (tokenizer.eos_token, tokenizer.unk_token) == ("<eos>", "<unk>")
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id] == [0, 1]
    assert [tokenizer.eos_token_id, tokenizer.unk_token_id] == [2, 3]
    assert len(tokenizer) == 4 + len(DEFAULT_ALPHABET) == 102


def test_one_token_per_character_and_bos_first(tokenizer) -> None:
    ids = tokenizer("37+45=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 7
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == list("37+45=")
    assert tokenizer("37+45=", add_special_tokens=False)["input_ids"] == ids[1:]
    assert tokenizer.eos_token_id not in ids  # the model writes EOS, encoding never adds it


def test_round_trips_every_task_string(tokenizer) -> None:
    rng = random.Random(0)
    tasks = [get_task("arithmetic"), get_task("arithmetic", ops="+-", max_operands=4, max_digits=6)]
    for task in tasks:
        for row in [*task.train[:300], *task.heldout[:100]]:
            noisy = task.noisy_solution(row, rng, 0.5)
            for text in (row["prompt"], row["solution"], row["answer"], noisy):
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                assert len(ids) == len(text) and tokenizer.unk_token_id not in ids
                assert tokenizer.decode(ids) == text
            full = tokenizer(row["prompt"] + row["solution"])["input_ids"] + [2, 0, 0]
            assert (
                tokenizer.decode(full, skip_special_tokens=True) == row["prompt"] + row["solution"]
            )


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=DEFAULT_ALPHABET, max_size=80))
def test_round_trips_any_ascii_text(text: str) -> None:
    tokenizer = build_char_tokenizer()
    assume(not any(t in text for t in SPECIAL_TOKENS))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text  # no spaces inserted, whitespace kept exactly


def test_unknown_characters_become_one_unk_each(tokenizer) -> None:
    text = "1€2😀3٣"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    unk = tokenizer.unk_token_id
    assert ids == [ids[0], unk, ids[2], unk, ids[4], unk]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "123"  # documented: dropped
    assert tokenizer.decode(ids) == "1<unk>2<unk>3<unk>"


def test_special_token_text_is_read_as_the_special_token(tokenizer) -> None:
    # As in every HF tokenizer: a literal "<eos>" in the text is the EOS token.
    assert tokenizer("1<eos>", add_special_tokens=False)["input_ids"][1] == tokenizer.eos_token_id


def test_restricted_alphabet() -> None:
    small = build_char_tokenizer("0123456789+=|,")
    assert len(small) == 18
    assert small("a1", add_special_tokens=False)["input_ids"] == [small.unk_token_id, 5]


def test_saved_tokenizer_loads_as_an_ordinary_fast_tokenizer(tokenizer, tmp_path) -> None:
    save_tokenizer(tokenizer, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # transformers 4 and 5
    assert config["clean_up_tokenization_spaces"] is False
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    text = "9+9+9=27,9+9+9+2=29|2997 \n" + string.ascii_letters
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text
    assert loaded.pad_token_id == 0 and loaded.eos_token_id == 2 and loaded.bos_token_id == 1
