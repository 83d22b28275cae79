"""Train sprig's demo model: a small Llama that solves multi-step arithmetic word problems.

Builds a BPE tokenizer (digits kept single) with a chat template whose eos is `<|end|>`,
trains `LlamaForCausalLM` with loss on the assistant's tokens only (problems packed several
to a row, `pack`), and saves a complete Hugging Face checkpoint. Deterministic for a given seed and step count on a given thread
count; `--minutes` is a safety cap that stops early (and then the result depends on speed).

    python scripts/train_demo_model.py --out runtime/demo/model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sprig.runtime.demo import tasks
from sprig.runtime.demo.evaluate import accuracy, generate

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained model."""

    out: str = "runtime/demo/model"
    seed: int = 0
    steps: int = 900
    minutes: float = 29.0
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 50
    vocab_size: int = 384
    hidden_size: int = 192
    layers: int = 6
    heads: int = 6
    eval_every: int = 300
    eval_problems: int = 64

    def __post_init__(self) -> None:
        if self.steps <= self.warmup or self.batch_size < 1 or self.minutes <= 0:
            raise ValueError("need steps > warmup, batch_size >= 1, minutes > 0")


def build_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE over `corpus` in which every digit (with its leading space) is one
    token; encoding with special tokens prepends `<s>`, so a raw-text prompt (a frontend's
    rendered roles) gets the same ids as the chat template."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(  # encode() adds <s>, as Llama's does
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|end|>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode(
    tok: PreTrainedTokenizerFast, problems: list[tasks.Problem]
) -> list[tuple[list[int], int]]:
    """(ids, prompt length) per problem; ids stop at eos, before the template's newline."""
    prompts = [
        tok.apply_chat_template(p.messages()[:1], add_generation_prompt=True, tokenize=False)
        for p in problems
    ]
    answers = [p.solution + tok.eos_token for p in problems]
    p_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    a_ids = tok(answers, add_special_tokens=False)["input_ids"]
    full = tok.apply_chat_template(problems[0].messages(), tokenize=False)
    assert tok(full, add_special_tokens=False)["input_ids"][:-1] == p_ids[0] + a_ids[0], (
        "split tokenization drifted"
    )
    return [(p + a, len(p)) for p, a in zip(p_ids, a_ids, strict=True)]


def pack(
    examples: list[tuple[list[int], int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, labels (-100 outside the assistant's tokens) and position ids, several
    examples to a row.

    Rows are as wide as the longest example; examples go longest first into the first row
    with room. Positions restart at 0 for each example, which is how transformers tells
    packed sequences apart: each attends only to itself, so the loss and its gradient are
    those of the examples padded one per row, with a third fewer positions computed.
    """
    width = max(len(ids) for ids, _ in examples)
    rows: list[list[tuple[list[int], int]]] = []
    room: list[int] = []
    for ex in sorted(examples, key=lambda e: -len(e[0])):
        at = next((r for r, free in enumerate(room) if free >= len(ex[0])), len(rows))
        if at == len(rows):
            rows.append([])
            room.append(width)
        rows[at].append(ex)
        room[at] -= len(ex[0])
    inputs = torch.full((len(rows), width), pad_id)  # [R, W]
    labels = torch.full((len(rows), width), -100)  # [R, W]
    positions = torch.zeros((len(rows), width), dtype=torch.long)  # [R, W]
    for r, row in enumerate(rows):
        at = 0
        for ids, n_prompt in row:
            end = at + len(ids)
            inputs[r, at:end] = torch.tensor(ids)
            labels[r, at + n_prompt : end] = torch.tensor(ids[n_prompt:])
            positions[r, at:end] = torch.arange(len(ids))
            at = end
    return inputs, labels, positions


def packed_loss(
    model: LlamaForCausalLM, examples: list[tuple[list[int], int]], pad_id: int
) -> torch.Tensor:
    """Mean cross-entropy over the examples' assistant tokens, computed packed (`pack`).
    Without a cache transformers reads the restarting positions as sequence boundaries."""
    inputs, labels, positions = pack(examples, pad_id)
    return model(input_ids=inputs, labels=labels, position_ids=positions, use_cache=False).loss


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / (cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def train(cfg: TrainConfig) -> None:
    """Build the tokenizer and model, train, and save the checkpoint to `cfg.out`."""
    torch.set_num_threads(2)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    train_set = tasks.take("train", cfg.steps * cfg.batch_size, seed=cfg.seed)
    evals = tasks.take("heldout", cfg.eval_problems, seed=cfg.seed + 1)
    tok = build_tokenizer(
        [p.question + "\n" + p.solution for p in train_set[:20000]], cfg.vocab_size
    )
    data = encode(tok, train_set)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.hidden_size * 8 // 3 // 32 * 32,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tok)}, {n_params / 1e6:.2f}M parameters, {len(data)} training problems")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    start = time.monotonic()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = packed_loss(
            model, data[step * cfg.batch_size : (step + 1) * cfg.batch_size], tok.pad_token_id
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.monotonic() - start
        if step % 100 == 0:
            print(
                f"step {step:5d}  loss {loss.item():.4f}  lr {lr_at(step, cfg):.2e}  "
                f"{elapsed / 60:.1f} min",
                flush=True,
            )
        last = step == cfg.steps - 1 or elapsed > cfg.minutes * 60
        if (step + 1) % cfg.eval_every == 0 or last:
            model.eval()
            acc = accuracy(evals, generate(model, tok, evals))
            model.train()
            print(f"step {step:5d}  held-out greedy accuracy {acc:.1%} on {len(evals)}", flush=True)
        if last:
            break
    save(model, tok, Path(cfg.out))
    print(
        f"trained {step + 1} steps in {(time.monotonic() - start) / 60:.1f} min; saved to {cfg.out}"
    )


def save(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> None:
    """Write weights, config, tokenizer (with chat template) and generation config."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    portable_tokenizer_config(out)
    GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    ).save_pretrained(str(out))


def portable_tokenizer_config(out: Path) -> None:
    """Keep the chat template in tokenizer_config.json and name the class older releases know."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config["additional_special_tokens"] = SPECIAL_TOKENS[3:]
    path.write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def main() -> None:
    """Parse flags (defaults from `TrainConfig`) and train."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in dataclasses.fields(TrainConfig):
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default
        )
    train(TrainConfig(**vars(parser.parse_args())))


if __name__ == "__main__":
    main()
