"""A tiny real checkpoint that writes Qwen3-Coder's XML tool calls ("qwen3_coder"), scripted.

Its tokenizer has the pieces of one call as (non-special) added tokens and a chat template
of our own (`TEMPLATE`) that writes the tools as XML, shows the call format (`<tool_call>`,
`<function=`, `<parameter=`: what makes the server pick qwen3_coder by itself), writes an
assistant's earlier calls back in that format and tool results in `<tool_response>`.
Greedy, after the template's generation prompt (`<|assistant|>\\n`, one added token) it
writes `SCRIPT_TEXT`, a sentence and then a call of get_weather:

    I will check.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call></s>

As in scripted_checkpoint.py, every layer's attention and MLP output projections are
zero, so the next token depends on the current token alone: the embeddings are one-hot per
script token and the LM head maps each to its successor with a margin. Two tokens have a
second choice, STEP below the first, for a grammar that refuses the first: after the
generation prompt `<tool_call>` (a forced call has no text before it), and after
`<tool_call>` a call of get_time (`<function=get_time>`, then `</function>`). Anything else
a grammar refuses gives way to the highest logit it allows, which is noise.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, AutoTokenizer

from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

# Arguments reach templates as a mapping: the server parses OpenAI's JSON text
# (runtime/server/request_builder.py, _call_for_template); text that is not a JSON object
# is written as it came.
TEMPLATE = (  # the server's Jinja (as transformers') trims a newline right after a block tag
    "{% if tools %}"
    "<|system|>\nYou may call these tools:\n<tools>"
    "{% for tool in tools %}"
    "{{ '\\n' }}<function>\n<name>{{ tool.function.name }}</name>\n"
    "<description>{{ tool.function.description or '' }}</description>\n"
    "<parameters>{{ (tool.function.parameters or {}) | tojson }}</parameters>\n</function>"
    "{% endfor %}"
    "{{ '\\n' }}</tools>\n"
    "To call one, write:\n<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n"
    "</function>\n</tool_call><|end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "<|tool|>\n<tool_response>\n{{ message.content }}\n</tool_response><|end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|assistant|>\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{{ '\\n' }}<tool_call>\n<function={{ fn.name }}>\n"
    "{% if fn.arguments is mapping %}"
    "{% for key, value in fn.arguments.items() %}"
    "<parameter={{ key }}>\n{{ value if value is string else value | tojson }}\n</parameter>\n"
    "{% endfor %}"
    "{% else %}"
    "{{ fn.arguments }}\n"
    "{% endif %}"
    "</function>\n</tool_call>"
    "{% endfor %}"
    "<|end|>\n"
    "{% else %}"
    "<|{{ message.role }}|>\n{{ message.content or '' }}<|end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
PROMPT_END = "<|assistant|>\n"  # the generation prompt, one token
CONTENT = "I will check."
ARGUMENTS = {"city": "Paris", "days": 3}
SCRIPT = [PROMPT_END, CONTENT + "\n", "<tool_call>", "\n<function=get_weather>\n", "<parameter=city>", "\nParis\n",
          "</parameter>", "\n<parameter=days>", "\n3", "\n</parameter>", "\n</function>", "\n</tool_call>"]  # then EOS
SCRIPT_TEXT = "".join(SCRIPT[1:])
CALL_TIME = ["\n<function=get_time>", "\n</function>"]  # after <tool_call>, second to get_weather
SECOND = {PROMPT_END: "<tool_call>", "<tool_call>": CALL_TIME[0], CALL_TIME[0]: CALL_TIME[1]}
MARGIN, STEP = 100.0, 30.0

assert SCRIPT_TEXT == (
    "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def build_coder_checkpoint(path: Path) -> Path:
    build_tiny_checkpoint(path, "llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens([AddedToken(t, normalized=False) for t in dict.fromkeys([*SCRIPT, CALL_TIME[0]])])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    ids = [*(tok.convert_tokens_to_ids(t) for t in SCRIPT), tok.eos_token_id]
    assert len(set(ids)) == len(ids) and tok.unk_token_id not in ids[:-1]
    assert tok.decode(ids[1:-1]) == SCRIPT_TEXT
    assert tok.encode(SCRIPT_TEXT, add_special_tokens=False) == ids[1:-1]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert tok.encode(prompt, add_special_tokens=False)[-1] == ids[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tokens = [*ids[:-1], tok.convert_tokens_to_ids(CALL_TIME[0])]  # each gets a one-hot dimension
    assert len(tokens) <= model.config.hidden_size
    dim = {token: d for d, token in enumerate(tokens)}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head.mul_(0.1)
        for token in tokens:
            embed[token] = 0.0
            embed[token, dim[token]] = 1.0
        for token, successor in itertools.pairwise(ids):
            head[successor, dim[token]] = MARGIN
        for token, successor in SECOND.items():
            head[tok.convert_tokens_to_ids(successor), dim[tok.convert_tokens_to_ids(token)]] = (
                MARGIN if token == CALL_TIME[0] else MARGIN - STEP)
    model.config.vocab_size = len(tok)
    model.save_pretrained(path, safe_serialization=True)
    return path
