"""Rollout: group bookkeeping, select_groups and concat."""

from __future__ import annotations

import pytest
import torch

from grouprl.rollout import Rollout


def _rollout(b=4, g=3, t=5) -> Rollout:
    n = b * g
    lengths = torch.arange(n) % t + 1  # (N,)
    mask = torch.arange(t)[None] < lengths[:, None]
    return Rollout(
        prompt_ids=torch.arange(b * 2).view(b, 2),
        prompt_mask=torch.ones(b, 2, dtype=torch.bool),
        completion_ids=torch.arange(n * t).view(n, t),
        mask=mask,
        old_logp=-torch.rand(n, t) * mask,
        truncated=lengths == t,
        texts=[f"c{i}" for i in range(n)],
        prompts=[f"p{i}" for i in range(b)],
        group_size=g,
        temperature=0.9,
        entropy=torch.rand(n, t) * mask,
    )


def test_properties():
    r = _rollout()
    assert r.num_prompts == 4
    assert r.group_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert r.lengths.tolist() == (torch.arange(12) % 5 + 1).tolist()


def test_select_groups_keeps_whole_groups_in_the_given_order():
    r = _rollout()
    s = r.select_groups([2, 0])
    assert s.prompts == ["p2", "p0"]
    assert s.texts == ["c6", "c7", "c8", "c0", "c1", "c2"]
    assert torch.equal(s.completion_ids, r.completion_ids[[6, 7, 8, 0, 1, 2]])
    assert torch.equal(s.prompt_ids, r.prompt_ids[[2, 0]])
    assert torch.equal(s.old_logp, r.old_logp[[6, 7, 8, 0, 1, 2]])
    assert torch.equal(s.entropy, r.entropy[[6, 7, 8, 0, 1, 2]])
    assert s.group_size == 3 and s.temperature == 0.9
    assert r.group_rows([2, 0]).tolist() == [6, 7, 8, 0, 1, 2]
    with pytest.raises(IndexError):
        r.select_groups([4])


def test_concat_repads_to_the_widest_part():
    a, b = _rollout(b=2, g=3, t=5), _rollout(b=1, g=3, t=3)
    b.prompt_ids, b.prompt_mask = b.prompt_ids[:, 1:], b.prompt_mask[:, 1:]
    c = Rollout.concat([a, b])
    assert c.num_prompts == 3 and c.completion_ids.shape == (9, 5)
    assert c.prompts == ["p0", "p1", "p0"] and c.texts[6:] == ["c0", "c1", "c2"]
    assert torch.equal(c.prompt_ids[2], torch.tensor([0, 1])) and not c.prompt_mask[2, 0]
    assert torch.equal(c.mask[6:, :3], b.mask) and not c.mask[6:, 3:].any()
    assert torch.equal(c.old_logp[6:, :3], b.old_logp) and (c.old_logp[6:, 3:] == 0).all()
    assert torch.equal(c.entropy[6:, :3], b.entropy) and (c.entropy[6:, 3:] == 0).all()
    b.entropy = None  # an engine without entropy: the concatenation has none either
    assert Rollout.concat([a, b]).entropy is None
    assert torch.equal(c.completion_ids[6:, :3], b.completion_ids)
    assert (c.completion_ids[6:, 3:] == c.pad_id).all()
    assert torch.equal(c.select_groups([2]).completion_ids[:, :3], b.completion_ids)
    with pytest.raises(ValueError):
        Rollout.concat([a, _rollout(b=1, g=2)])


def test_inconsistent_shapes_are_rejected():
    r = _rollout()
    with pytest.raises(ValueError):
        Rollout(**{**r.__dict__, "group_size": 5})
    with pytest.raises(ValueError):
        Rollout(**{**r.__dict__, "entropy": r.entropy[:, :2]})


def test_loss_mask_defaults_to_mask_and_travels_with_the_rows():
    r = _rollout()
    assert r.loss_mask is r.mask and torch.equal(r.sampled_lengths, r.lengths)
    loss_mask = r.mask.clone()
    loss_mask[:, 1] = False  # as if position 1 were a tool's observation in every row
    t = Rollout(**{**r.__dict__, "loss_mask": loss_mask})
    assert torch.equal(t.sampled_lengths, r.lengths - r.mask[:, 1].long())
    s = t.select_groups([2, 0])
    assert torch.equal(s.loss_mask, loss_mask[t.group_rows([2, 0])])
    both = Rollout.concat([t.select_groups([0]), r.select_groups([1])])
    assert torch.equal(both.loss_mask[:3], loss_mask[:3]) and torch.equal(
        both.loss_mask[3:], r.mask[3:6]
    )
    assert torch.equal(t.to("cpu").loss_mask, loss_mask) and t.regroup(1).loss_mask is loss_mask
    (piece, _), *_ = t.chunks(3)
    assert torch.equal(piece.loss_mask, loss_mask[:3])
    with pytest.raises(ValueError, match="subset of mask"):
        Rollout(**{**r.__dict__, "loss_mask": ~r.mask})
