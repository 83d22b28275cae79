"""LoRA adapters for the tiny checkpoints, written by PEFT itself, and PEFT's greedy
tokens with them: the reference sprig's adapters are checked against."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

# Phi-3's checkpoint modules holding several of Llama's (PEFT adapts them whole)
FUSED_MODULES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                 "up_proj": "gate_up_proj"}


def fused_targets(targets: list[str]) -> list[str]:
    """Llama's module names as a Phi-3 checkpoint's, which fuse q/k/v and gate/up."""
    return sorted({FUSED_MODULES.get(t, t) for t in targets})


def peft_adapter(base: Path, out: Path, *, seed: int, targets: list[str], r: int = 8, alpha: float = 16,
                 scale: float = 1.0, **config) -> Path:
    """A PEFT LoRA adapter of `base` at `out` (written once), its A and B random (PEFT's
    `init_lora_weights=False`), B times `scale` so that it moves the tokens."""
    if not (out / "adapter_config.json").exists():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                init_lora_weights=False, **config))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
        peft.save_pretrained(out)
    return out


def edit_config(adapter: Path, out: Path, **changes) -> Path:
    """A copy of `adapter` at `out` with adapter_config.json's keys changed."""
    out.mkdir(parents=True, exist_ok=True)
    for f in adapter.iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((adapter / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(config | changes))
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt with PEFT's adapter (None: the
    base model), each prompt alone."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return model_greedy(model, AutoTokenizer.from_pretrained(base), prompts, max_new_tokens)


def model_greedy(model: torch.nn.Module, tok: Any, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """`model`'s greedy continuation of each prompt, each alone."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok.encode(p)])
            gen = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(gen[0, ids.shape[1] :].tolist())
    return outs
