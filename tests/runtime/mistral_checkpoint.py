"""A tiny real checkpoint that writes Mistral's v11 tool calls ("mistral_v11"), scripted.

Its tokenizer has Mistral's markers as special tokens (`MARKERS`: `[TOOL_CALLS]`, `[ARGS]`,
`[CALL_ID]`, `[INST]`, `[AVAILABLE_TOOLS]`, `[TOOL_RESULTS]` and their closing tags), so
decoding that skips special tokens drops them, and a chat template of Mistral Small 3.2's
shape (`TEMPLATE`): the tools in `[AVAILABLE_TOOLS]` before the last user message, an
assistant's calls as `[TOOL_CALLS]NAME[ARGS]{...}`, tool results in `[TOOL_RESULTS]`, no
generation prompt. Greedy, after a user message (`[/INST]`) it writes

    Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>

with both markers the special tokens, and after a tool result (`[/TOOL_RESULTS]`)
` gamma</s>`. As in scripted_checkpoint.py every layer's attention and MLP output
projections are zero, so the next token depends on the current one alone: the embeddings
are one-hot per script token and the LM head maps each to its successor with a margin. A
token a grammar refuses gives way to the highest logit it allows, which is noise.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
CONTENT, ARGUMENTS, ANSWER = " Sure.", '{"city": "Paris"}', " gamma"
WORDS = [CONTENT, "get_weather", ARGUMENTS, ANSWER]
SUCCESSOR = {"[/INST]": CONTENT, CONTENT: "[TOOL_CALLS]", "[TOOL_CALLS]": "get_weather", "get_weather": "[ARGS]",
             "[ARGS]": ARGUMENTS, ARGUMENTS: "</s>", "[/TOOL_RESULTS]": ANSWER, ANSWER: "</s>"}
SCRIPT_TEXT = f"{CONTENT}[TOOL_CALLS]get_weather[ARGS]{ARGUMENTS}"
MARGIN = 100.0
LAST_USER = (  # where the tools are rendered: before the last user message
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
)
TURNS = (  # the conversation after the system prompt (a system message renders nothing here)
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- endif %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' %}{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}[TOOL_CALLS]{{ call.function.name }}[ARGS]"
    "{%- if call.function.arguments is string %}{{ call.function.arguments }}"
    "{%- else %}{{ call.function.arguments | tojson }}{%- endif %}"
    "{%- endfor %}{{ eos_token }}"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- endif %}"
    "{%- endfor %}"
)
TEMPLATE = LAST_USER + "{{- bos_token }}" + TURNS


def add_mistral_tokens(path: Path, markers: list[str] = MARKERS, words: list[str] = WORDS,
                       template: str = TEMPLATE) -> PreTrainedTokenizerBase:
    """The tokenizer saved at `path` with `markers` (special) and the script's `words`
    added, and `template` as its chat template; saved back."""
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens([AddedToken(m, special=True, normalized=False) for m in markers], special_tokens=True)
    tok.add_tokens([AddedToken(w, normalized=False) for w in words])
    tok.chat_template = template
    tok.save_pretrained(path)
    return tok


def write_script(path: Path, tok: PreTrainedTokenizerBase, successor: dict[str, str]) -> Path:
    """The checkpoint at `path` made to write, greedy, `successor[t]` after each token `t`
    (each a single token of `tok`)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in {*successor, *successor.values()}}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    model.config.vocab_size = len(tok)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head.mul_(0.1)
        for dim, (token, after) in enumerate(successor.items()):
            embed[ids[token]] = 0.0
            embed[ids[token], dim] = 1.0
            head[ids[after], dim] = MARGIN
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_mistral_checkpoint(path: Path) -> Path:
    build_tiny_checkpoint(path, "mistral")
    tok = add_mistral_tokens(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in [*MARKERS, *WORDS, "</s>"]}
    assert tok.encode(SCRIPT_TEXT, add_special_tokens=False) == [ids[t] for t in list(SUCCESSOR)[1:6]]
    return write_script(path, tok, SUCCESSOR)
