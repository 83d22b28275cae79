"""Distil a draft model for speculative decoding from sprig's demo model.

The student is a small `LlamaForCausalLM` with the demo model's tokenizer (the same
vocabulary and token ids, as `--speculative-algorithm draft` requires). It learns the
teacher's next-token distribution (KL divergence from the teacher's softmax, temperature 1)
on the assistant's tokens of the demo task's training dialogues (arithmetic word problems
worked step by step, `sprig.runtime.demo.mixture.arithmetic_dialogue`), batched by length
as the demo model is trained (`train_demo_model.length_groups`). Weights are saved in
bfloat16 beside the teacher's tokenizer. Training runs under bfloat16 autocast where the
CPU multiplies bfloat16 fast (`--bf16`, `train_demo_model.use_bf16`). Deterministic for a
given seed, thread count and autocast setting.
At the end it reports how many of its greedy drafts the demo model accepts on held-out
problems, served by sprig with `--speculative-algorithm draft`.

    python scripts/train_draft_model.py --out runtime/demo/draft --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from train_demo_model import (
    BF16_MODES,
    encode,
    length_groups,
    llama_config,
    lr_at,
    padded,
    save,
    use_bf16,
)
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sprig.runtime import Engine
from sprig.runtime.demo import DEMO_MODEL_PATH, mixture, tasks
from sprig.runtime.demo.evaluate import prompts


@dataclass(frozen=True)
class DraftConfig:
    """What determines the draft. The learning rate follows `train_demo_model.lr_at`
    (warmup, a constant peak, linear decay to a tenth over the last `decay` steps)."""

    out: str = "runtime/demo/draft"
    teacher: str = str(DEMO_MODEL_PATH)
    seed: int = 0
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 20
    decay: int = 150
    hidden_size: int = 128
    layers: int = 3
    heads: int = 4
    threads: int = 1
    bf16: str = "auto"  # bfloat16 autocast: "on", "off" or "auto" (`train_demo_model.use_bf16`)
    eval_problems: int = 32
    max_bytes: int = 2 << 20  # the saved weights' limit

    def __post_init__(self) -> None:
        if self.steps < self.warmup + self.decay or self.batch_size < 1 or self.threads < 1:
            raise ValueError("need steps >= warmup + decay, batch_size >= 1 and threads >= 1")
        if self.hidden_size % self.heads:
            raise ValueError("hidden_size must be a multiple of heads")
        if self.bf16 not in BF16_MODES:
            raise ValueError(f"--bf16 must be one of {', '.join(BF16_MODES)}, not {self.bf16!r}")

    @property
    def total_steps(self) -> int:  # what `lr_at` schedules over
        return self.steps


def student_config(cfg: DraftConfig, teacher: LlamaConfig) -> LlamaConfig:
    return llama_config(cfg.hidden_size, cfg.layers, cfg.heads, vocab_size=teacher.vocab_size,
                        max_positions=teacher.max_position_embeddings, bos=teacher.bos_token_id,
                        eos=teacher.eos_token_id, pad=teacher.pad_token_id, rms_norm_eps=teacher.rms_norm_eps)


def distill_loss(student: LlamaForCausalLM, teacher: LlamaForCausalLM, batch: list, pad_id: int) -> torch.Tensor:
    """Mean KL(teacher || student) of the next-token distributions at the assistant's tokens,
    a length group of dialogues at a time, one to a right-padded row."""
    total, count = torch.zeros(()), 0
    for group in length_groups(batch):
        inputs, labels, _ = padded(group, pad_id)  # [N, W] each
        with torch.no_grad():
            want = teacher(input_ids=inputs, use_cache=False).logits[:, :-1].float()
        got = student(input_ids=inputs, use_cache=False).logits[:, :-1].float()
        mask = labels[:, 1:] != -100  # [N, W-1]: predicting an assistant token
        total = total + torch.nn.functional.kl_div(
            got[mask].log_softmax(-1), want[mask].log_softmax(-1), log_target=True, reduction="sum")
        count += int(mask.sum())
    return total / count


def acceptance(cfg: DraftConfig) -> str:
    """Greedy held-out problems served with the draft: its drafts' acceptance rate."""
    with Engine(cfg.teacher, dtype="float32", speculative_algorithm="draft", speculative_draft_model_path=cfg.out,
                speculative_pass_costs="1,0,0,0,0,0,0", speculative_num_draft_tokens=4) as engine:
        texts = prompts(engine.tokenizer, tasks.take("heldout", cfg.eval_problems, seed=0))
        engine.generate(texts, {"max_new_tokens": 128, "temperature": 0})
        stats = engine.scheduler.speculative.stats
        return (f"{stats.accepted} of {stats.drafted} drafts accepted ({stats.acceptance_rate:.1%}), "
                f"{stats.mean_accept_length:.2f} tokens per verification pass")


def train(cfg: DraftConfig) -> None:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    start = time.monotonic()
    tok = PreTrainedTokenizerFast.from_pretrained(cfg.teacher)
    teacher = LlamaForCausalLM.from_pretrained(cfg.teacher, dtype=torch.float32).eval()
    dialogues = [mixture.arithmetic_dialogue(p) for p in tasks.take("train", cfg.steps * cfg.batch_size, seed=cfg.seed)]
    data = encode(tok, dialogues)
    student = LlamaForCausalLM(student_config(cfg, teacher.config))
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    n_params = sum(p.numel() for p in student.parameters())
    print(f"{n_params / 1e6:.2f}M parameters, {len(data)} dialogues; data ready in {time.monotonic() - start:.0f} s",
          flush=True)
    bf16, why = use_bf16(cfg.bf16, teacher.config.hidden_size)
    print(why, flush=True)
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = data[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = distill_loss(student, teacher, batch, tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == cfg.steps - 1:
            print(f"step {step:4d}  KL {loss.item():.4f}  {(time.monotonic() - start) / 60:.1f} min", flush=True)
    save(student.to(torch.bfloat16).eval(), tok, Path(cfg.out))
    size = (Path(cfg.out) / "model.safetensors").stat().st_size
    if size > cfg.max_bytes:
        raise SystemExit(f"the draft's weights are {size} bytes, over the {cfg.max_bytes} allowed")
    print(f"saved to {cfg.out}: weights {size / 1e6:.2f} MB; {(time.monotonic() - start) / 60:.1f} min", flush=True)
    print(f"held-out greedy, {cfg.eval_problems} problems: {acceptance(cfg)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(DraftConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", default=f.default, type=type(f.default))
    train(DraftConfig(**vars(parser.parse_args())))


if __name__ == "__main__":
    main()
