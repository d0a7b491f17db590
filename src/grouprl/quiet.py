"""What the Hugging Face libraries print while grouprl runs (no heavy import until called)."""

from __future__ import annotations

import warnings


def quiet_hf() -> None:
    """grouprl's own progress output is enough: no progress bars from the HF libraries (and no
    warning from tqdm, imported by them in a notebook without ipywidgets, that its notebook bars
    are unavailable)."""
    warnings.filterwarnings("ignore", message="IProgress not found")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
