"""A tiny random Gemma 3 vision-language checkpoint, as gemma-3-4b-it ships one: the model,
a tokenizer with Gemma's three image tokens, a chat template that writes
`<start_of_image>` for an image part, and the image processor's config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sprig.runtime.tiny_checkpoint import build_tokenizer

IMAGE_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
TOKENS_PER_IMAGE = 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_vision_checkpoint(path: Path, *, sliding_window: int = 6, seed: int = 0) -> Path:
    """Write the checkpoint to `path` (a directory); its images are 28 x 28 pixels, 16
    patches pooled to `TOKENS_PER_IMAGE` tokens. The window (shorter than an image's
    sequence with its newlines) makes sliding layers and image blocks meet."""
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    build_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(  # as Gemma's tokenizer_config.json names its image tokens
        str(path), extra_special_tokens=dict(zip(("boi_token", "image_token", "eoi_token"), IMAGE_TOKENS, strict=True)))
    tok.add_special_tokens({"additional_special_tokens": ["<|end|>", *IMAGE_TOKENS]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    begin, image, end = tok.convert_tokens_to_ids(IMAGE_TOKENS)
    text = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=sliding_window,
        max_position_embeddings=512, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        initializer_range=0.2, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=28, patch_size=7)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                          image_token_index=image, boi_token_index=begin, eoi_token_index=end)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # Gemma's norms start at zero (a scale of 1): perturb them so a wrong norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        # transformers starts the projection at zero: image embeddings as large as token embeddings instead
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.copy_(torch.randn_like(projection) * 0.3)
    model.save_pretrained(str(path))
    Gemma3ImageProcessor(size={"height": 28, "width": 28}).save_pretrained(str(path))
    return path


def random_image(seed: int, size: tuple[int, int] = (40, 32)) -> Image.Image:
    """A random RGB image (width, height) of its own seed."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
