"""Training: configuration, the GRPO/GSPO loop, evaluation, supervised warm start, checkpoints."""
