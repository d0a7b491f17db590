"""grouprl: critic-free RL (GRPO, GSPO and their variants) for language-model reasoning."""

__version__ = "0.1.0"
