"""Third-party progress bars off under the bench's own: Hugging Face's loading bars (transformers' "Loading
weights", huggingface_hub's downloads) write to stderr whether or not it is a terminal, and interleave with ours."""

from __future__ import annotations

import os


def silence_library_bars() -> None:
    """Turn off the bars and chatter of transformers and huggingface_hub for this process (the bench's own bar and
    lines stay)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read by huggingface_hub when imported later
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # transformers is a test / baseline dependency only
        return
    hf_logging.set_verbosity_error()  # deprecation chatter would break our bar's line too
    hf_logging.disable_progress_bar()  # also huggingface_hub's bars
