"""Loading a checkpoint's Hugging Face tokenizer from a local directory."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the checkpoint; a clear error if there is none."""
    path = Path(model_path)
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a directory")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {e}") from None
