"""Reward functions and scoring with them: the arithmetic task's `correct` and `format`
(`arithmetic`), math answers (`math`: `accuracy`, `think_format`), programs run in the sandbox
(`code`), reward models (`model`), what every reward reads alike (`common`), and rewards by name
and scoring a batch with them (`scoring`)."""
