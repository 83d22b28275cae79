"""Draft models for the tiny test checkpoints: real, smaller Hugging Face checkpoints
that share a target's tokenizer, built in-process."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@functools.cache
def truncated_draft(target: Path, layers: int = 1) -> Path:
    """The target's first `layers` decoder layers, with its embedding, final norm and head:
    a smaller model whose greedy tokens often agree with the target's (drafts get
    accepted), saved beside the target with its tokenizer."""
    out = target.parent / f"{target.name}-draft-{layers}"
    if not (out / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
        model.save_pretrained(out, safe_serialization=True)
        copy_tokenizer(target, out)
    return out


def copy_tokenizer(source: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
