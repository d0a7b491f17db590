"""The example's reward, in TRL's shape: chat completions are lists of messages, and the last one
is the model's final reply."""


def right_sum(completions, answer, **kwargs):
    """1.0 when the final reply is exactly the sum, else 0.0."""
    return [1.0 if c[-1]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]
