"""Train sprig's demo model: a small Llama that works arithmetic word problems step by
step, calls tools, extracts JSON, answers from facts in its prompt and keeps track of a
conversation (the mixture of `sprig.runtime.demo.mixture`).

Training begins with `copy_steps` steps of a copying warm-up (`sprig.runtime.demo.copying`:
short lists repeated back), which the mixture's tasks, all answered by copying from the
prompt, then build on. Builds a BPE tokenizer (digits kept single; the tool-call markers
whole tokens) with the chat template of `sprig.runtime.demo.chat_format`, trains
`LlamaForCausalLM` with loss on every assistant turn (a task's turns weighted as
`--task-weights` says, 1 by default; with `--prompt-weight`, less on the rest; dialogues
of similar length batched together, `batch_loss`) under bfloat16 autocast where the CPU
runs it fast (`--bf16`, `use_bf16`), compiled by `torch.compile` (`--compile`; it needs a
C++ compiler), and saves a complete Hugging Face checkpoint. Deterministic for a given
seed, step count, thread count (`--threads`, two by default), autocast and compile setting; with
`--state-dir` it saves its state as it goes, and `--resume` continues a run that stopped
(see `TrainConfig`).

    python scripts/train_demo_model.py --out runtime/demo/model [--state-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sprig.runtime.cpu_matmul import matmul_slowdown
from sprig.runtime.demo import copying, mixture, tasks
from sprig.runtime.demo.chat_format import CHAT_TEMPLATE, SPECIAL_TOKENS, TOOL_TOKENS
from sprig.runtime.demo.dialogue import Dialogue
from sprig.runtime.demo.evaluate import accuracy, generate

Example = tuple[list[int], list[int], float]  # token ids, labels (-100 where no loss), the labels' loss weight
BF16_MODES = ("auto", "on", "off")
BF16_MAX_SLOWDOWN = 2.0  # "auto" trains under bfloat16 autocast unless its matmuls are this many times slower
GROUP_SPREAD = 1.3  # a length group's longest dialogue is at most this many times its shortest (`length_groups`)
_TURN = re.compile(re.escape("<|assistant|>\n") + r"(.*?)" + re.escape("<|end|>"), re.DOTALL)
_MARKERS = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TOKENS))


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained model, and where a run keeps its state.

    The run is `copy_steps` steps of the copying warm-up (batches of `copy_batch_size`
    dialogues), then `steps` steps of the mixture (batches of `batch_size`), counted as one
    run of `total_steps`. The mixture's last `no_arithmetic_steps` steps draw no arithmetic
    (the other tasks take its share), which holds arithmetic back while the rest trains on;
    up to there the data is the plain mixture's. The learning rate warms up over `warmup`
    steps, holds, and decays linearly to a tenth over the last `decay` steps, so a run of
    N steps is a run of M < N steps up to step M - `decay`: a run can be resumed from a
    saved state (`--resume`) and extended, and the result is the one a run of the final
    length from scratch gives."""

    out: str = "runtime/demo/model"
    seed: int = 0
    steps: int = 1300
    batch_size: int = 64
    copy_steps: int = 500  # the copying warm-up before the mixture (0: none)
    copy_batch_size: int = 64
    no_arithmetic_steps: int = 0  # the mixture's last this many steps leave the arithmetic task out
    lr: float = 3e-3
    warmup: int = 60
    decay: int = 250
    vocab_size: int = 1024
    hidden_size: int = 256
    layers: int = 6
    heads: int = 8
    max_positions: int = 1024
    prompt_weight: float = 0.0  # loss weight of the tokens outside assistant turns (1 on the turns)
    task_weights: str = ""  # loss weight of some tasks' assistant turns, "few-shot=1.5,tools=0.7" (others 1)
    word_tokens: bool = False  # a space before a word is a token of its own (`build_tokenizer`; ~20% more tokens)
    bf16: str = "auto"  # bfloat16 autocast around forward and loss: "on", "off" or "auto" (`use_bf16`)
    compile: bool = True  # train through torch.compile(dynamic=True): faster steps; needs a C++ compiler
    threads: int = 2
    eval_every: int = 300  # steps between held-out loss lines (about 3 s each)
    eval_dialogues: int = 24
    eval_problems: int = 64
    state_dir: str = ""  # save tokenizer, model and optimizer state here every `save_every` steps
    save_every: int = 100
    resume: str = ""  # a state file written to state_dir: continue from it

    def __post_init__(self) -> None:
        if self.steps < self.warmup + self.decay or self.batch_size < 1:
            raise ValueError("need steps >= warmup + decay and batch_size >= 1")
        if self.copy_steps < 0 or self.copy_batch_size < 1:
            raise ValueError("need copy_steps >= 0 and copy_batch_size >= 1")
        if not 0 <= self.no_arithmetic_steps <= self.steps:
            raise ValueError("need 0 <= no_arithmetic_steps <= steps")
        if not 0.0 <= self.prompt_weight <= 1.0 or self.threads < 1:
            raise ValueError("need 0 <= prompt_weight <= 1 and threads >= 1")
        if self.hidden_size % self.heads:
            raise ValueError("hidden_size must be a multiple of heads")
        if self.resume and not self.state_dir:
            raise ValueError("--resume needs --state-dir (where the run's tokenizer is)")
        if self.bf16 not in BF16_MODES:
            raise ValueError(f"--bf16 must be one of {', '.join(BF16_MODES)}, not {self.bf16!r}")
        parse_task_weights(self.task_weights)  # a malformed --task-weights is refused before training starts

    @property
    def total_steps(self) -> int:
        return self.copy_steps + self.steps


def parse_task_weights(text: str) -> dict[str, float]:
    """"few-shot=1.5,tools=0.7" read as task name to the loss weight of its assistant turns,
    for the tasks it names: each a task of the mixture, each weight finite and positive."""
    weights: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        name, _, value = (part.strip() for part in item.partition("="))
        if name not in mixture.TASKS:
            raise ValueError(f"--task-weights names {name!r}, not a task of the mixture ({', '.join(mixture.TASKS)})")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"--task-weights: {item!r} is not TASK=WEIGHT") from None
        if not 0.0 < weight < float("inf"):
            raise ValueError(f"--task-weights: the weight of {name} must be positive and finite, not {value}")
        weights[name] = weight
    return weights


def bf16_slowdown(hidden_size: int) -> float:
    """How many times longer a bfloat16 matmul of a training step's shape ([2048, hidden] by
    [hidden, 8/3 hidden]) takes than the float32 one on this CPU (`matmul_slowdown`). On
    AVX512, autocast made a step of the demo model ~1.35x faster."""
    return matmul_slowdown(torch.bfloat16, 2048, hidden_size, hidden_size * 8 // 3)


def use_bf16(mode: str, hidden_size: int) -> tuple[bool, str]:
    """Whether to train under bfloat16 autocast ("on", "off", or "auto": on unless this CPU's
    bfloat16 matmuls are over `BF16_MAX_SLOWDOWN` times slower than float32 ones), and a line
    for the log that says why. The shipped checkpoints were trained with autocast on; the
    same recipe in float32 gives a different checkpoint."""
    if mode != "auto":
        return mode == "on", f"bfloat16 autocast {mode} (--bf16 {mode})"
    slowdown = bf16_slowdown(hidden_size)
    if slowdown <= BF16_MAX_SLOWDOWN:
        return True, f"bfloat16 autocast on: a bfloat16 matmul takes {slowdown:.2f}x float32's time on this CPU"
    return False, (f"bfloat16 autocast off: a bfloat16 matmul takes {slowdown:.0f}x float32's time on this CPU "
                   "(no fast bfloat16 path), so training runs in float32; the checkpoint will differ from the "
                   "shipped one, trained with autocast on (--bf16 on forces it)")


def build_tokenizer(corpus: list[str], vocab_size: int, word_tokens: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE over `corpus` (rendered chats; special tokens are cut out before
    training) in which every digit (with its leading space) is one token, with
    `word_tokens` a space before a word is a token of its own — so a word is the same
    tokens at the start of a line, after a space or inside JSON quotes, and copying it
    is copying the same ids — and each tool-call marker is one plain token, kept by decoding. Encoding with special tokens
    prepends `<s>`, so a raw-text prompt (a frontend's rendered roles) gets the same ids
    as the chat template."""
    tok = Tokenizer(models.BPE(unk_token=None))
    words = [pre_tokenizers.Split(Regex(r" (?=\p{L})"), behavior="isolated")] if word_tokens else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?\d"), behavior="isolated"),
            *words,
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
    pieces = (p for text in corpus for p in _MARKERS.split(text) if p)
    tok.train_from_iterator(pieces, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
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


def render(tok: PreTrainedTokenizerFast, dialogue: Dialogue) -> str:
    """The whole dialogue as the chat template writes it (no generation prompt)."""
    tools = list(dialogue.tools) if dialogue.tools else None
    return tok.apply_chat_template(list(dialogue.messages), tools=tools, tokenize=False)


def target_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of every assistant turn's text and its closing `<|end|>`: what the
    model learns to write. Only the template writes these markers, so each
    `<|assistant|>\\n ... <|end|>` is one turn."""
    return [(m.start(1), m.end()) for m in _TURN.finditer(text)]


def encode(tok: PreTrainedTokenizerFast, dialogues: list[Dialogue],
           task_weights: dict[str, float] | None = None) -> list[Example]:
    """(ids, labels, weight) per dialogue: the rendered text tokenized as a server tokenizes
    it, labels on the tokens inside `target_spans` (every token lies wholly in or out), and
    the loss weight of those tokens: its task's in `task_weights`, else 1."""
    if not dialogues:  # the tokenizer refuses an empty batch
        return []
    weights = task_weights or {}
    texts = [render(tok, d) for d in dialogues]
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [(ids, _labels(text, ids, offsets), weights.get(d.task, 1.0)) for d, text, ids, offsets in
            zip(dialogues, texts, enc["input_ids"], enc["offset_mapping"], strict=True)]


def _labels(text: str, ids: list[int], offsets: list[tuple[int, int]]) -> list[int]:
    labels = [-100] * len(ids)
    spans = target_spans(text)
    k = 0
    for i, (a, b) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= a:
            k += 1
        if k == len(spans) or b <= spans[k][0] or a == b:
            continue
        if a < spans[k][0] or b > spans[k][1]:
            raise AssertionError(f"a token straddles a turn boundary: {text[a:b]!r}")
        labels[i] = ids[i]
    return labels


def length_groups(examples: list[Example]) -> list[list[Example]]:
    """The examples shortest first, cut into groups whose longest is at most `GROUP_SPREAD`
    times their shortest: each group becomes one right-padded tensor (`padded`), so padding
    stays small (about 11% more positions on the mixture) and attention in a group is as
    long as its dialogues, not the batch's longest."""
    groups: list[list[Example]] = []
    for ex in sorted(examples, key=lambda e: len(e[0])):
        if not groups or len(ex[0]) > GROUP_SPREAD * len(groups[-1][0][0]):
            groups.append([])
        groups[-1].append(ex)
    return groups


def padded(group: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, labels (-100 outside the assistant's tokens and on padding) and each
    token's example weight (0 on padding), one example to a row, padded on the right."""
    width = max(len(ids) for ids, _, _ in group)
    inputs = torch.full((len(group), width), pad_id)  # [N, W]
    labels = torch.full((len(group), width), -100)  # [N, W]
    weights = torch.zeros((len(group), width))  # [N, W]
    for r, (ids, target, weight) in enumerate(group):
        inputs[r, : len(ids)] = torch.tensor(ids)
        labels[r, : len(ids)] = torch.tensor(target)
        weights[r, : len(ids)] = weight
    return inputs, labels, weights


class TargetLoss(torch.nn.Module):
    """A causal LM's next-token cross-entropy at chosen positions of a right-padded batch.

    The model's body runs over every position; its head and the softmax run only at the
    positions given, where the loss has weight. At weight 0 on the prompt (the default)
    that is about a fifth of the mixture's positions, so the head's matmuls and the
    float32 logits are that much smaller. Compiled as one graph in training
    (`torch.compile`)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor,
                weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs [N, W]; rows, cols, targets, weights [P]: position (rows[i], cols[i])
        predicts targets[i] with loss weight weights[i]. Returns the weighted sum of the
        losses and the sum of the weights."""
        hidden = self.model.model(input_ids=inputs, use_cache=False).last_hidden_state  # [N, W, H]
        logits = self.model.lm_head(hidden[rows, cols])  # [P, V]
        losses = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")  # [P]
        return (losses * weights).sum(), weights.sum()


def batch_loss(loss: torch.nn.Module, examples: list[Example], pad_id: int, prompt_weight: float = 0.0) -> torch.Tensor:
    """Weighted mean cross-entropy of next tokens over `examples`: each example's weight on
    the assistant's tokens, `prompt_weight` on every other token of a dialogue but its first
    (so 0 and weights of 1 give the mean over the assistant's tokens alone). `loss` is a
    `TargetLoss` (or it compiled).

    Computed a length group at a time (`length_groups`), one dialogue to a row. Attention is
    causal and the padding is on the right, so no row sees padding or another dialogue, and
    the loss and its gradient are those of each dialogue run alone. A group of one dialogue
    gets a second row of padding alone, with no weight: torch.compile specialises a
    dimension of size 1, and a one-row tensor would compile the step again. Attention runs on
    torch's plain (math) path: at these lengths the CPU's fused kernel was slower, forward
    and back."""
    total, norm = torch.zeros(()), torch.zeros(())
    blank: Example = ([pad_id], [-100], 0.0)
    with sdpa_kernel(SDPBackend.MATH):
        for group in length_groups(examples):
            inputs, labels, example_weights = padded(group if len(group) > 1 else [*group, blank], pad_id)
            nexts, targets = inputs[:, 1:], labels[:, 1:]  # [N, W-1]
            weights = torch.where(targets != -100, example_weights[:, 1:],
                                  prompt_weight * (example_weights[:, 1:] > 0))  # [N, W-1]
            rows, cols = weights.nonzero(as_tuple=True)  # [P] each: the positions whose next token counts
            if rows.numel():
                group_total, group_norm = loss(inputs, rows, cols, nexts[rows, cols], weights[rows, cols])
                total, norm = total + group_total, norm + group_norm
    return total / norm


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, a constant peak, then linear decay to a tenth over the last `decay` of
    `cfg.total_steps`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    left = cfg.total_steps - step
    return cfg.lr if left > cfg.decay else cfg.lr * (0.1 + 0.9 * left / cfg.decay)


def batch_at(step: int, cfg: TrainConfig, copies: list[Example], data: list[Example]) -> list[Example]:
    """The dialogues of `step`: copying for the first `copy_steps`, then the mixture."""
    if step < cfg.copy_steps:
        return copies[step * cfg.copy_batch_size : (step + 1) * cfg.copy_batch_size]
    at = step - cfg.copy_steps
    return data[at * cfg.batch_size : (at + 1) * cfg.batch_size]


def training_dialogues(cfg: TrainConfig) -> list[Dialogue]:
    """The mixture's dialogues in training order, `batch_size` a step; the last
    `no_arithmetic_steps` steps' batches hold no arithmetic."""
    return mixture.take("train", cfg.steps * cfg.batch_size, seed=cfg.seed, without=frozenset({"arithmetic"}),
                        from_=(cfg.steps - cfg.no_arithmetic_steps) * cfg.batch_size)


def train(cfg: TrainConfig) -> None:
    """Build (or, resuming, load) the tokenizer and model, train, and save the checkpoint."""
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)  # without it two compiled runs of one config gave different weights
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    start = time.monotonic()
    train_set = training_dialogues(cfg)
    if cfg.resume:
        tok = PreTrainedTokenizerFast.from_pretrained(cfg.state_dir)
    else:
        tok = build_tokenizer([render_plain(d) for d in train_set[:20000]], cfg.vocab_size, cfg.word_tokens)
        if cfg.state_dir:
            tok.save_pretrained(cfg.state_dir)
    data = encode(tok, train_set, parse_task_weights(cfg.task_weights))
    copies = encode(tok, copying.take_copies("train", cfg.copy_steps * cfg.copy_batch_size, seed=cfg.seed))
    held_out = {name: encode(tok, mixture.take_task(name, "heldout", cfg.eval_dialogues, seed=cfg.seed + 1))
                for name in mixture.TASKS}
    problems = tasks.take("heldout", cfg.eval_problems, seed=cfg.seed + 1)
    model = LlamaForCausalLM(model_config(cfg, tok))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    bf16, why = use_bf16(cfg.bf16, cfg.hidden_size)
    print(why, flush=True)
    loss_of = TargetLoss(model)
    trained = torch.compile(loss_of, dynamic=True) if cfg.compile else loss_of  # shares model's parameters
    first = 0
    if cfg.resume:
        state = torch.load(cfg.resume, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first = state["step"]
    n_params = sum(p.numel() for p in model.parameters())
    tokens = sum(len(ids) for ids, _, _ in data)
    print(f"vocab {len(tok)}, {n_params / 1e6:.2f}M parameters, {len(data)} training dialogues, "
          f"{tokens / 1e6:.1f}M tokens; data ready in {time.monotonic() - start:.0f} s; from step {first}"
          + (f"; task loss weights {cfg.task_weights}" if cfg.task_weights else ""), flush=True)
    start, cpu_start = time.monotonic(), time.process_time()
    for step in range(first, cfg.total_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = batch_at(step, cfg, copies, data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = batch_loss(trained, batch, tok.pad_token_id, cfg.prompt_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0:
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {lr_at(step, cfg):.2e}  "
                  f"{(time.monotonic() - start) / 60:.1f} min, CPU {(time.process_time() - cpu_start) / 60:.1f} min",
                  flush=True)
        if (step + 1) % cfg.eval_every == 0 or step == cfg.total_steps - 1:
            print(f"step {step:5d}  held-out loss " + held_out_losses(model, held_out, tok.pad_token_id), flush=True)
        if cfg.state_dir and (step + 1) % cfg.save_every == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1},
                       Path(cfg.state_dir) / f"state-{step + 1}.pt")
    model.eval()
    print(f"held-out arithmetic, greedy: {accuracy(problems, generate(model, tok, problems)):.1%} "
          f"of {len(problems)}", flush=True)
    save(model, tok, Path(cfg.out))
    print(f"trained steps {first}-{cfg.total_steps} in {(time.monotonic() - start) / 60:.1f} min "
          f"(process CPU time {(time.process_time() - cpu_start) / 60:.1f} min); saved to {cfg.out}")


def model_config(cfg: TrainConfig, tok: PreTrainedTokenizerFast) -> LlamaConfig:
    return llama_config(cfg.hidden_size, cfg.layers, cfg.heads, vocab_size=len(tok), max_positions=cfg.max_positions,
                        bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.pad_token_id)


def llama_config(hidden_size: int, layers: int, heads: int, *, vocab_size: int, max_positions: int,
                 bos: int, eos: int, pad: int, rms_norm_eps: float = 1e-5) -> LlamaConfig:
    """The demo models' shape: a Llama with tied embeddings, as many KV heads as heads and
    an MLP 8/3 as wide as the model (rounded down to a multiple of 32)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3 // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=rms_norm_eps,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=True,
    )


def render_plain(dialogue: Dialogue) -> str:
    """A dialogue's text for training the BPE: every turn and the tools' JSON."""
    tools = [json.dumps(t["function"]) for t in dialogue.tools or ()]
    turns = [m["content"] for m in dialogue.messages]
    turns += [json.dumps(c["function"]) for m in dialogue.messages for c in m.get("tool_calls", ())]
    return "\n".join(tools + turns)


@torch.no_grad()
def held_out_losses(model: LlamaForCausalLM, held_out: dict[str, list[Example]], pad_id: int) -> str:
    """Each task's loss on its held-out dialogues, as one line."""
    model.eval()
    losses = {name: batch_loss(TargetLoss(model), examples, pad_id).item() for name, examples in held_out.items()}
    model.train()
    return "  ".join(f"{name} {loss:.3f}" for name, loss in losses.items())


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
        kind = type(f.default)
        parser.add_argument(f"--{f.name.replace('_', '-')}", default=f.default,
                            type=(lambda v: v.lower() in ("1", "true", "yes")) if kind is bool else kind)
    train(TrainConfig(**vars(parser.parse_args())))


if __name__ == "__main__":
    main()
