"""Parallelism: the torchrun job and its collectives (`distributed`), FSDP2 and the rule it brings,
that every rank runs the same forward passes (`fsdp`). Nothing here knows the training batch."""
