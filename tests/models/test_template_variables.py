"""--chat-template-kwargs: variables every chat-template render gets (Qwen3's enable_thinking),
the caller's own keywords winning, through copies and pickling, and a run's prompts rendered
with them."""

import copy
import json
import pickle

from grouprl.config import TrainConfig
from grouprl.models.loading import with_template_variables
from grouprl.models.tiny import save_tiny_chat_model
from grouprl.rollout.sampling import encode_prompts
from grouprl.train.build import load_run_tokenizer

TEMPLATE = (
    "{% if enable_thinking is defined and enable_thinking is false %}NOTHINK {% endif %}"
    "{{ messages[0]['content'] }}{% if add_generation_prompt %}<|im_start|>{% endif %}"
)
HI = [{"role": "user", "content": "hi"}]


def test_every_render_gets_the_variables_and_the_callers_keywords_win(tmp_path):
    _, tokenizer = save_tiny_chat_model(tmp_path, template=TEMPLATE)
    assert tokenizer.apply_chat_template(HI, tokenize=False) == "hi"
    given = with_template_variables(tokenizer, {"enable_thinking": False})
    assert given.apply_chat_template(HI, tokenize=False) == "NOTHINK hi"
    assert given.apply_chat_template(HI, tokenize=False, enable_thinking=True) == "hi"
    for again in (copy.deepcopy(given), pickle.loads(pickle.dumps(given))):
        assert again.apply_chat_template(HI, tokenize=False) == "NOTHINK hi"
    given.save_pretrained(tmp_path / "saved")  # the saved tokenizer's template is its own
    saved = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert "enable_thinking" not in {k for k in saved if k != "chat_template"}


def test_the_runs_tokenizer_renders_prompts_with_them(tmp_path):
    """train, eval and generate load their tokenizer through load_run_tokenizer."""
    save_tiny_chat_model(tmp_path / "model", template=TEMPLATE)
    for variables, start in (({"enable_thinking": False}, "NOTHINK hi"), (None, "hi")):
        cfg = TrainConfig(model=str(tmp_path / "model"), chat_template_kwargs=variables)
        _, texts = encode_prompts(load_run_tokenizer(cfg), [HI])
        assert texts == [start + "<|im_start|>"]
