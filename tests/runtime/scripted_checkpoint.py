"""A tiny real checkpoint whose greedy output is scripted: a "thinking" model.

Its tokenizer has `<think>` and `</think>` as (non-special) added tokens. Every layer's
attention and MLP output projections are zero, so the residual stream is the current
token's embedding and the next-token logits depend on the current token alone; the
embeddings and LM head then map each token of `SCRIPT` to its successor with a margin no
other token comes near. Greedy, after a prompt ending in "\\n" the model writes

    <think> alpha beta</think> gamma</s>

(what Qwen3 writes: reasoning, then the answer). Under a grammar, a script token the
grammar forbids gives way to the highest logit it allows, which is noise but deterministic.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

THINK_TEMPLATE = (  # Qwen3's shape: `enable_thinking=false` closes an empty think block in the prompt
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
OPEN_THINK_TEMPLATE = (  # DeepSeek-R1's shape: the prompt opens the think block
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n<think>' }}{% endif %}"
)
SCRIPT = ["\n", "<think>", " alpha", " beta", "</think>", " gamma", "</s>"]
REASONING, ANSWER = "alpha beta", "gamma"
MARGIN = 100.0


def build_thinking_checkpoint(path: Path) -> Path:
    build_tiny_checkpoint(path, "llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(path)
    ids = [tok.convert_tokens_to_ids(t) if t.startswith("<") else tok.encode(t, add_special_tokens=False)[0]
           for t in SCRIPT]
    assert tok.decode(ids[1:-1]) == "<think> alpha beta</think> gamma"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head.mul_(0.1)
        for dim, (token, successor) in enumerate(itertools.pairwise(ids)):
            embed[token] = 0.0
            embed[token, dim] = 1.0
            head[successor, dim] = MARGIN
    model.config.vocab_size = len(tok)
    model.save_pretrained(path, safe_serialization=True)
    return path
