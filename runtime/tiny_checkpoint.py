"""Build tiny, real Hugging Face checkpoints offline: a trained byte-level BPE tokenizer
with a chat template, and a randomly initialised Llama-family model (dense, or mixture-of-experts)
Gemma 2/3, OLMo 2/3, SmolLM3, Granite, gpt-oss or Phi-3/Phi-4.

They load through exactly the code path real checkpoints take, which is what tests and
the no-hub quick start need. The weights are random: the text they produce is noise.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (  # tools and tool calls in the Hermes format (`server.tool_calls`)
    "{% if tools %}{{ '<|system|>\nTools:\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ 'Call one as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call><|end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>\n' + call['function'] | tojson + '\n</tool_call>' }}"
    "{% endfor %}{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|end|>"]
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "olmo3", "smollm3", "granite")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")  # 4 experts, 2 per token
# Phi3ForCausalLM (fused qkv and gate/up tensors): "phi3" as Phi-4 (plain RoPE, its own head),
# "phi4_mini" as Phi-4-mini (longrope, 3/4 of each head rotated, a tied head)
PHI3_ARCHITECTURES = ("phi3", "phi4_mini")

_WORDS = ["the", "a", "an", "of", "to", "in", "and", "is", "was", "for", "on", "with", "as", "by", "at", "from", "it", "that", "this", "which", "be", "are", "model", "token", "cache", "prefix", "radix", "tree", "request", "batch", "decode", "prefill", "answer", "question", "what", "how", "why", "when", "where", "who", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "Paris", "France", "capital", "city", "river", "number", "sum", "add", "plus", "minus", "times", "result", "step", "think", "alpha", "beta", "gamma", "delta", "cat", "dog", "bird", "fish", "red", "green", "blue", "quick", "brown", "fox", "jumps", "over", "lazy", "hello", "world", "system", "user", "assistant", "yes", "no", "true", "false", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "-", "=", "?"]


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ":", ",", ""]))
    lines.append('{"name": "x", "age": 12, "tags": ["a", "b"]} [1, 2, 3] (a) <b> é ü 中文')
    return lines


def build_tokenizer(path: str | Path, vocab_size: int = 512, seed: int = 0):
    """Train a byte-level BPE on generated text and save it as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(2000, seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        additional_special_tokens=["<|end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def longrope_parameters(rotary_dim: int, **extra) -> dict:
    """A longrope `rope_parameters` for heads rotating `rotary_dim` dims: short and long
    factors, different in every dimension (so that a wrong choice shows), and `extra` keys."""
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [1.5 + 2.0 * i for i in range(half)], **extra}


def _config(arch: str, vocab_size: int, bos: int, eos: int, overrides: dict):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Olmo2Config,
        Olmo3Config,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        SmolLM3Config,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":
        common.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    if arch == "qwen2_moe":
        common.update(shared_expert_intermediate_size=96)
    if arch == "gpt_oss":  # sliding (a window shorter than most test prompts) and full layers alternate; YaRN x4
        common.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=16, sliding_window=8,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 256})
    if arch in ("gemma2", "gemma3"):  # a window shorter than most test prompts, so that it bites
        common.update(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, tie_word_embeddings=True,
                      architectures=["Gemma2ForCausalLM" if arch == "gemma2" else "Gemma3ForCausalLM"])
    if arch == "gemma2":  # caps that bite on the tiny model's scores and logits
        common.update(attn_logit_softcapping=1.5, final_logit_softcapping=4.0)
    common.update(overrides)
    if arch == "olmo3":  # a window shorter than most test prompts
        common.setdefault("sliding_window", 8)
    if arch == "smollm3":  # the second of two layers without RoPE; its default pad id is past the tiny vocabulary
        common.setdefault("no_rope_layer_interval", 2)
        common.setdefault("pad_token_id", eos)
    if arch == "granite":  # Granite 3's scalars, none of them 1
        for key, value in (("embedding_multiplier", 12.0), ("residual_multiplier", 0.22),
                           ("attention_multiplier", 0.2), ("logits_scaling", 8.0)):
            common.setdefault(key, value)
    if arch in PHI3_ARCHITECTURES:  # its default pad id is past the tiny vocabulary
        common.setdefault("pad_token_id", eos)
    if arch == "phi4_mini":  # the factors of a context within the original length: the short ones
        common["tie_word_embeddings"] = overrides.get("tie_word_embeddings", True)
        common.setdefault("partial_rotary_factor", 0.75)
        common.setdefault("original_max_position_embeddings", common["max_position_embeddings"])
        rotary_dim = int(common["hidden_size"] // common["num_attention_heads"] * common["partial_rotary_factor"])
        common.setdefault("rope_parameters", longrope_parameters(rotary_dim, factor=32.0))
    if arch in ("gemma3", "olmo3"):  # sliding and full layers alternate
        kinds = ("sliding_attention", "full_attention")
        common.setdefault("layer_types", [kinds[i % 2] for i in range(common["num_hidden_layers"])])
    cls = {"gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "gpt_oss": GptOssConfig, "olmo2": Olmo2Config, "olmo3": Olmo3Config, "smollm3": SmolLM3Config, "granite": GraniteConfig,
           "phi3": Phi3Config, "phi4_mini": Phi3Config, "llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig}[arch]
    if arch in ("qwen3", "qwen3_moe"):
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
    if arch in ("mistral", "mixtral"):
        common.setdefault("sliding_window", None)
    return cls(**common)


def build_tiny_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = 512,
    **config_overrides,
) -> Path:
    """Write a tokenizer and a random `arch` model (one of ARCHITECTURES,
    MOE_ARCHITECTURES or PHI3_ARCHITECTURES) to `path`.

    `config_overrides` go to the transformers config (e.g. `num_key_value_heads=1`,
    `tie_word_embeddings=True`, `rope_scaling={...}`). Deterministic for a given seed.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    known = ARCHITECTURES + MOE_ARCHITECTURES + PHI3_ARCHITECTURES
    if arch not in known:
        raise ValueError(f"arch must be one of {known}, got {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path, vocab_size=vocab_size, seed=seed)
    config = _config(arch, len(tok), tok.bos_token_id, tok.eos_token_id, config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # norms start at ones, sinks near 0; perturb them so a wrong norm or sink shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("sinks"):
                p.normal_(0.0, 2.0)
    model.save_pretrained(str(path), safe_serialization=True)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(
        str(path)
    )
    (path / "sprig_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return path
