"""Shared helpers for engine tests: prompts, transformers references, the KV checks."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sprig.runtime import Engine
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep

WORDS = ["the", "a", "cat", "dog", "model", "token", "cache", "prefix", "tree", "request", "what", "how", "one", "two", "three", "red", "blue", "quick", "fox"]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` prompts of varied lengths (about 2 to 40 tokens)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25))) for _ in range(n)]


def hf_greedy(path: Path, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, run alone (no padding)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok.encode(p)])
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def hf_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids`: `[len, V]`."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_idle_and_intact(engine: Engine) -> None:
    """Every request finished, the KV accounting exact, nothing leaked."""
    sched = engine.scheduler
    assert not sched.waiting and not sched.running and sched.chunked is None
    sched.check_integrity()
    kv = sched.kv
    assert kv.allocator.available() + kv.cache.evictable_size() == kv.allocator.size
    assert kv.cache.protected_size() == 0 and kv.table.available() == kv.table.size


def contexts_step(
    mode: ForwardMode, input_ids: list[int], q_lens: list[int], contexts: list[torch.Tensor], logits_from: list[int]
) -> ForwardStep:
    """A `ForwardStep` from one slot tensor per request."""
    return ForwardStep(mode, input_ids, q_lens, [c.numel() for c in contexts], torch.cat(contexts), logits_from)
