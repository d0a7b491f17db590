"""--model FILE.gguf: a GGUF file loads as a plain model of its architecture with the logits of
the model it was written from, trains with LoRA, and its final/ loads with transformers; what is
not a usable GGUF file is one line."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers
from packaging.version import Version

from grouprl.cli import main
from grouprl.errors import UserError
from grouprl.models import load_model, load_tokenizer
from grouprl.models.loading import GGUF_TRANSFORMERS

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None, reason="gguf is not installed: pip install gguf"
    ),
    pytest.mark.skipif(
        Version(transformers.__version__) < Version(GGUF_TRANSFORMERS),
        reason=f"GGUF loading needs transformers >= {GGUF_TRANSFORMERS}",
    ),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gguf_files import write_tiny_llama

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    model, tok = write_tiny_llama(path)
    return path, model, tok


def test_a_gguf_file_loads_with_the_source_models_logits_and_tokenizer(tiny, tmp_path):
    path, source, tok = tiny
    model = load_model(str(path))
    tokenizer = load_tokenizer(str(path))
    assert (
        type(model).__name__ == "LlamaForCausalLM" and getattr(model, "hf_quantizer", None) is None
    )
    ids = tok.encode("12+7=19").ids
    assert tokenizer("12+7=19", add_special_tokens=False)["input_ids"] == ids
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
    x = torch.tensor([ids])
    with torch.no_grad():  # the same float32 weights through the same kernels: the same bits
        assert torch.equal(model(x).logits, source(x).logits)
    model.save_pretrained(tmp_path / "saved")  # a plain model: serialisable

    # a converter that forgot the q/k permutation still loads, but its logits differ
    from gguf_files import write_tiny_llama

    write_tiny_llama(tmp_path / "unpermuted.gguf", permute_qk=False)
    with torch.no_grad():
        wrong = load_model(str(tmp_path / "unpermuted.gguf"))(x).logits
        right = source(x).logits
    # far outside float32 rounding of this forward (terms ≲ 1e3, u32 = 2⁻²⁴ of max |logit|)
    assert (wrong - right).abs().max() > 10 * 1e3 * 2**-24 * right.abs().max()


def test_a_gguf_model_trains_with_lora_and_its_final_loads_with_transformers(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _, _ = tiny
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n"
                            for a in range(1, 60)))  # fmt: skip
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def right(completions, answer, **kw):\n"
        "    return [float(a in c) for c, a in zip(completions, answer)]\n"
    )
    run = tmp_path / "run"
    assert main(["train", "--model", str(path), "--dataset", str(data), "--rewards",
                 f"{rewards}:right", "1.0", "--lora-r", "4", "--steps", "2", "--max-new-tokens", "8",
                 "--prompts-per-step", "4", "--group-size", "2", "--eval-size", "2",
                 "--eval-samples", "1", "--threads", "1", "--no-progress", "--log-ratios", "0",
                 "--output-dir", str(run)]) == 0  # fmt: skip
    final = AutoModelForCausalLM.from_pretrained(run / "final")
    assert type(final).__name__ == "LlamaForCausalLM"
    adapter = json.loads((run / "final" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(path)  # the adapter names the file
    merged = load_model(str(run / "final" / "adapter"))  # base from the file + the adapter
    x = torch.tensor([[5, 6, 7]])
    with torch.no_grad():  # the same merge of the same weights as final/'s: the same bits
        assert torch.equal(merged(x).logits, final(x).logits)


def test_what_is_not_a_usable_gguf_file_is_one_line(tmp_path, monkeypatch):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    with pytest.raises(UserError, match="is not a GGUF file"):
        load_model(str(text))
    import gguf

    odd = tmp_path / "odd.gguf"  # a real GGUF file of an architecture transformers lacks
    w = gguf.GGUFWriter(str(odd), "nosucharch")
    w.add_tensor("x.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match=f"cannot load a causal LM from {tmp_path}") as raised:
        load_model(str(odd))
    assert "\n" not in str(raised.value)
    with pytest.raises(UserError, match="no such GGUF file"):
        load_model(str(tmp_path / "missing.gguf"))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(UserError, match=r"pip install 'grouprl\[gguf\]'"):
        load_model(str(text))
