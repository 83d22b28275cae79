"""Score a causal LM on the demo task with transformers: greedy accuracy and majority vote."""

from __future__ import annotations

from collections import Counter
from typing import Any

from sprig.runtime.demo.tasks import Problem, extract_answer


def prompts(tokenizer: Any, problems: list[Problem]) -> list[str]:
    """Each problem's question, chat-formatted up to the assistant's turn, without the
    leading `<s>`: the tokenizer adds it when the text is encoded (as a server does)."""
    bos = tokenizer.bos_token or ""
    texts = [
        tokenizer.apply_chat_template(p.messages()[:1], add_generation_prompt=True, tokenize=False)
        for p in problems
    ]
    return [t[len(bos) :] if bos and t.startswith(bos) else t for t in texts]


def generate(
    model: Any,
    tokenizer: Any,
    problems: list[Problem],
    *,
    num_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 64,
    max_new_tokens: int = 128,
) -> list[list[str]]:
    """`num_samples` completions per problem; greedy when `temperature` is 0, else sampled
    at `temperature` from the nucleus `top_p`."""
    import torch

    tokenizer.padding_side = "left"
    texts = prompts(tokenizer, problems)
    out: list[list[str]] = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(
            texts[i : i + batch_size], padding=True, return_tensors="pt"
        )
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
            if temperature > 0
            else {"do_sample": False}
        )
        with torch.no_grad():
            ids = model.generate(
                **enc,
                **sampling,
                num_return_sequences=num_samples,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )  # [batch * num_samples, prompt + new]
        decoded = tokenizer.batch_decode(
            ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
        )
        out.extend(decoded[j : j + num_samples] for j in range(0, len(decoded), num_samples))
    return out


def majority(answers: list[int | None]) -> int | None:
    """The most common parsed answer (first seen wins ties), or None if none parsed."""
    counts = Counter(a for a in answers if a is not None)
    return counts.most_common(1)[0][0] if counts else None


def accuracy(problems: list[Problem], completions: list[list[str]], vote: bool = False) -> float:
    """Fraction right: of the first completion, or of the majority vote when `vote`."""
    right = 0
    for p, texts in zip(problems, completions, strict=True):
        answers = [extract_answer(t) for t in texts]
        right += (majority(answers) if vote else answers[0]) == p.answer
    return right / len(problems)
