"""A second reward for the built-in arithmetic task, for comparing GRPO with GDPO:

    grouprl compare --algos grpo,gdpo --rewards correct 1.0 examples/gdpo/rewards.py:digits 0.5

`correct` (1 or 0) says whether the answer is right; `digits` gives partial credit, the share
of the answer's digits that are right, aligned from the last (units) digit. The two rewards
vary differently inside a group: GRPO normalises their weighted sum, GDPO each one first."""


def digits(completions, answer, **kwargs):
    """Share of the answer's digits the completion's final answer (after the last |) gets
    right, counted from the units digit; 0 when there is no final answer."""
    scores = []
    for completion, truth in zip(completions, answer, strict=True):
        if "|" not in completion:
            scores.append(0.0)
            continue
        given = completion.rsplit("|", 1)[-1].strip()
        truth = str(truth)
        hits = sum(a == b for a, b in zip(reversed(given), reversed(truth), strict=False))
        scores.append(hits / max(len(truth), len(given), 1))
    return scores
