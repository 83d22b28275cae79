"""A tiny real checkpoint that writes OpenAI's harmony format (gpt-oss's), scripted.

Its tokenizer has the harmony markers as special tokens and gpt-oss's own chat template
(`fixtures/gpt_oss_chat_template.jinja`); `<|return|>` and `<|call|>` end generation (its
generation_config's eos ids, as gpt-oss's). Greedy, after the template's generation
prompt, it writes

    <|channel|>analysis<|message|> alpha beta<|end|><|start|>assistant<|channel|>final<|message|> gamma<|return|>

or, when the prompt holds tools (the template writes `namespace functions`) and no tool
result (`"sunny"`) yet, a call in place of the final message:

    ...<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

How: the first layer's MLP and the second layer are silenced, so the residual stream is
the token's one-hot embedding plus what one attention layer adds, and the LM head maps
each script token to its successor. `<|channel|>` and `<|message|>` are followed by
different tokens in one output, so their successor also depends on three flags, each an
attention head whose query (those two tokens') finds one key token anywhere before it:
` alpha` (the analysis was written), `namespace` (tools) and `sunny` (a tool result).
Queries and keys sit on the slowest rotary frequencies, so a key scores alike at any
distance; every other token's embedding is zero on the dimensions they read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

TEMPLATE = Path(__file__).parent / "fixtures" / "gpt_oss_chat_template.jinja"
MARKERS = ["<|start|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]  # <|end|> is there
ARGS = '{"city": "Paris"}'
WORDS = ["assistant", "analysis", "final", "commentary", " to=functions.get_weather ", "json", " alpha", " beta",
         " gamma", ARGS, "namespace", "sunny"]
REASONING, ANSWER, TOOL_RESULT = " alpha beta", " gamma", "sunny"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
PLAIN = f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
CALLING = (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>commentary "
           f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>")

SUCCESSOR = {"assistant": "<|channel|>", "analysis": "<|message|>", "final": "<|message|>",
             "commentary": " to=functions.get_weather ", " to=functions.get_weather ": "<|constrain|>",
             "<|constrain|>": "json", "json": "<|message|>", " alpha": " beta", " beta": "<|end|>",
             "<|end|>": "<|start|>", "<|start|>": "assistant", " gamma": "<|return|>", ARGS: "<|call|>"}
# after these the flags choose: (no analysis yet, answer, call)
BRANCHES = {"<|channel|>": ("analysis", "final", "commentary"), "<|message|>": (" alpha", " gamma", ARGS)}
FLAGS = (" alpha", "namespace", "sunny")  # analysis written, tools given, a tool result given
MARGIN, STEP, FLAG = 100.0, 30.0, 40.0  # FLAG / 2 < STEP < FLAG: the flags decide between the branches
QUERY_KEY = 16.0  # query and key size: a found key scores QUERY_KEY**2 / 4 above every other token


def build_harmony_checkpoint(path: Path) -> Path:
    build_tiny_checkpoint(path, "llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS], special_tokens=True)
    tok.add_tokens([AddedToken(w, normalized=False) for w in WORDS])
    tok.chat_template = TEMPLATE.read_text()
    tok.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<|end|>", *MARKERS, *WORDS]}
    for text in (PLAIN, CALLING):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    stops = [tok.eos_token_id, ids["<|return|>"], ids["<|call|>"]]
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=stops).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    _script(model, ids)
    model.config.vocab_size = len(tok)
    model.generation_config.eos_token_id = stops
    model.save_pretrained(path, safe_serialization=True)
    return path


def _script(model, ids: dict[str, int]) -> None:
    tokens = [*SUCCESSOR, *BRANCHES, "namespace", "sunny"]
    dim = {t: i for i, t in enumerate(tokens)}  # each script token's one-hot dimension
    flag_dim = [len(tokens) + i for i in range(len(FLAGS))]
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    first, second = model.model.layers
    attn = first.self_attn
    head_dim = model.config.head_dim
    scale = model.config.hidden_size ** 0.5  # what RMSNorm makes of a one-hot embedding
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # the norms
                p.fill_(1.0)
        for w in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
                  first.mlp.down_proj.weight, second.self_attn.o_proj.weight, second.mlp.down_proj.weight):
            w.zero_()
        embed[:, : flag_dim[-1] + 1] = 0.0
        for t, d in dim.items():
            embed[ids[t], d] = 1.0
        head.mul_(0.01)
        for t, successor in SUCCESSOR.items():
            head[ids[successor], dim[t]] = MARGIN
        # (query head, its key/value head, the rotary dimension it reads, the value dimension)
        heads = ((0, 0, head_dim // 2 - 1, 0), (2, 1, head_dim // 2 - 1, 0), (1, 0, head_dim // 2 - 2, 1))
        for (q_head, kv_head, rot, value), key, flag in zip(heads, FLAGS, flag_dim, strict=True):
            for query in BRANCHES:
                attn.q_proj.weight[q_head * head_dim + rot, dim[query]] = QUERY_KEY / scale
            attn.k_proj.weight[kv_head * head_dim + rot, dim[key]] = QUERY_KEY / scale
            attn.v_proj.weight[kv_head * head_dim + value, dim[key]] = 1.0 / scale
            attn.o_proj.weight[flag, q_head * head_dim + value] = 1.0
        analysis, tools, result = flag_dim
        for query, (start, answer, call) in BRANCHES.items():
            head[ids[start], dim[query]] = MARGIN
            head[ids[answer], dim[query]] = MARGIN - STEP
            head[ids[call], dim[query]] = MARGIN - 2 * STEP
        for _, answer, call in BRANCHES.values():
            head[ids[answer], analysis] = FLAG
            head[ids[call], analysis] = FLAG
            head[ids[call], tools] = FLAG
            head[ids[call], result] = -FLAG
