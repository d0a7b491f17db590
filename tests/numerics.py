"""The tolerances the tests derive, in one place, with their reasons.

Two kinds of floating-point claim appear in the suite, and each gets its own kind of bound:

- "The same computation" (a prompt shared or not, chunked or not, KV-cached or not, merged or
  not): the two sides compute the same mathematical function and differ only in the order of
  their sums. Such claims are checked in float64, where reordering is invisible next to any
  real difference. Bound: a reordered sum of n terms moves by at most n·u·Σ|terms| (u = 2^-53);
  the models here accumulate n < 10^4 products on the way to any value, and their terms cancel
  by at most ~10^3 (Σ|terms| <= 10^3·|value|), so |Δ| <= 10^4 · 1.1e-16 · 10^3 ≈ 1e-9 of the
  magnitude compared (`F64_SAME`). A real difference (a wrong position, a missing term, a
  dropped layer) is of the order of the magnitude itself. float32 would leave only ~10^3 between
  rounding and some real errors, and its rounding differs between CPUs and thread counts.
- A float32 result against a float64 or hand-computed one, or two float32 forwards of the same
  function: a bound from u = 2^-24 and the lengths and magnitudes involved (`forward_bound`).
- "A policy that did not move": a learning rate of 1e-12 changes no float32 weight larger than
  1e-12 · 2^24 ≈ 1.7e-5 in magnitude (the step is under half an ulp, |w|·2^-24, and rounds
  away); the few smaller weights move by 1e-12 each. So the forward is the same computation,
  and a quantity that compares the policy before and after an update (a ratio, a log-ratio) is
  exactly what it would be without the update, up to those few weights: under 1e-6 in log-prob
  terms for the bundled model. The tests allow 1e-5 per ratio (`UNMOVED`).
"""

from __future__ import annotations

import torch

U32 = 2.0**-24
U64 = 2.0**-53
#: Relative tolerance of "the same computation" in float64 (see above).
F64_SAME = 1e-9
#: How far a ratio of a policy trained at lr 1e-12 may be from 1 (see above).
UNMOVED = 1e-5


def forward_bound(config, magnitude: float, tokens: int = 1) -> float:
    """A bound on the float32 rounding difference between two forwards of the same function
    (other shapes, a cached decode against a full forward) of a log-prob, summed over `tokens`:
    each logit accumulates over at most n = layers · (2·hidden + intermediate) + hidden products
    on its way, so it is off by at most n·u·`magnitude` (the largest |logit|), and a log-prob,
    logit − logsumexp, by twice that. Worst case: first-order and pessimistic (the measured
    differences are ~1000× smaller), but it holds on any CPU."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = text.num_hidden_layers * (2 * text.hidden_size + text.intermediate_size)
    n += text.hidden_size
    return tokens * 2 * n * U32 * magnitude


def assert_same_f64(got: torch.Tensor, want: torch.Tensor, *, scale: torch.Tensor | None = None):
    """`got` equals `want` (both float64) to `F64_SAME` of the largest magnitude of `scale`
    (default: of `want`)."""
    assert got.dtype == want.dtype == torch.float64, (got.dtype, want.dtype)
    magnitude = float((want if scale is None else scale).detach().abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=F64_SAME * max(magnitude, 1e-30))


def _rms_norm_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def to_float64(model: torch.nn.Module) -> torch.nn.Module:
    """`model` computing in float64 throughout, for "the same computation" checks.

    transformers' RMSNorm computes in float32 whatever its input (it is written for bf16
    models), which would put float32 rounding into every layer of a float64 comparison (measured:
    gradients of two orderings then differ by ~1e-7 relative); here it keeps its input's dtype.
    Rotary tables are still computed in float32, but from the position alone, so both sides of
    a comparison get the same ones."""
    import types

    model = model.double()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
    return model


def assert_same_function(merged, adapter, base, ids):
    """`merged` (a plain model) computes what `adapter` (base + LoRA) does, to float32 rounding.

    Bound: the two forwards differ only in rounding (W·x + s·B·A·x against (W + s·B·A)·x), and
    float32 rounding (u = `U32`) of a forward accumulates over at most n = layers · (2·hidden +
    intermediate) + hidden products on the way to a logit, so |Δ| <= n·u·max|logits| (2.4e-3 for
    the bundled model's 4 layers of 128/512 and logits of ~12). The adapter's own effect on the
    logits must be far larger (a merge that dropped or double-counted it would then fail)."""
    c = merged.config
    n = c.num_hidden_layers * (2 * c.hidden_size + c.intermediate_size) + c.hidden_size
    got, want = merged(input_ids=ids).logits, adapter(input_ids=ids).logits
    bound = n * U32 * float(want.abs().max())
    effect = float((want - base(input_ids=ids).logits).abs().max())
    assert effect > 100 * bound, (effect, bound)  # the check can tell a merged adapter apart
    torch.testing.assert_close(got, want, atol=bound, rtol=0)


def assert_merged_weights(merged, adapter):
    """Every weight of `merged` is the adapter model's merged weight: W + s·B·A for each LoRA
    layer, within the rounding of a float32 merge, (r + 2)·u·(|W| + s·|B|·|A|) elementwise (r
    products summed, a scale, an add; u = `U32`); every other weight is the base's, exactly."""
    expected = {}
    for name, module in adapter.named_modules():
        if "default" in getattr(module, "lora_A", {}):
            W, A, B = (t.detach().double() for t in (module.base_layer.weight,
                       module.lora_A["default"].weight, module.lora_B["default"].weight))  # fmt: skip
            s, r = module.scaling["default"], A.shape[0]
            bound = (r + 2) * U32 * (W.abs() + s * B.abs() @ A.abs())
            expected[name.removeprefix("base_model.model.") + ".weight"] = (W + s * B @ A, bound)
    base = adapter.get_base_model().state_dict()
    got = merged.state_dict()
    assert expected and set(expected) <= set(got)
    for key, value in got.items():
        if key in expected:
            want, bound = expected[key]
            assert ((value.double() - want).abs() <= bound).all(), key
        else:
            assert torch.equal(value, base[key]), key


def logit_magnitude(model) -> float:
    """A bound on every logit a Llama/Qwen2-style model can produce, from its weights alone: the
    head reads the final RMSNorm's output γ ⊙ x/rms(x), whose x/rms(x) has norm √d, so by
    Cauchy-Schwarz |logit_v| <= √d · ‖W_v ⊙ γ‖₂ (the `magnitude` of `forward_bound`)."""
    gamma = model.get_decoder().norm.weight.detach().double()  # (d,)
    head = model.get_output_embeddings().weight.detach().double()  # (V, d)
    return float((head * gamma).norm(dim=-1).max()) * gamma.numel() ** 0.5


def assert_greedy_agrees(model, ids, hf, ours) -> list[int]:
    """Greedy rollouts `ours` (another engine's) pick the HF model's argmax, as `hf` (grouprl's
    engine) does, wherever its top-2 gap exceeds twice the float32 rounding a logit can take
    between two forwards of the same function (`forward_bound`: n·u times the largest logit, per
    side); each row is checked up to its first position below. Returns the rows' split points."""
    bound = forward_bound(model.config, logit_magnitude(model))  # 2·n·u·M
    splits, compared = [], 0
    for row in range(len(ids)):
        full = torch.tensor([ids[row] + hf.completion_id_lists()[row]])
        with torch.no_grad():
            logits = model(full).logits[0, len(ids[row]) - 1 : -1]  # (T, V) predicting each
        top2 = logits.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        split = next((t for t, gap in enumerate(gaps) if gap <= bound), len(gaps))
        splits.append(split)
        want = hf.completion_id_lists()[row][:split]
        got = ours.completion_id_lists()[row][: len(want)]
        assert got == want, (row, split)
        compared += len(want)
        if split == len(gaps):  # no near tie: the rows end alike too
            assert ours.completion_id_lists()[row] == hf.completion_id_lists()[row]
            assert bool(ours.truncated[row]) == bool(hf.truncated[row])
    assert compared >= len(ids) * 8, splits  # the check compared real positions
    return splits
