"""Chat templates, rendered in Jinja's immutable sandbox.

The template is the model's own (its tokenizer's `chat_template`) or the file given with
`--chat-template`, compiled once at start-up; a client never supplies one.
`chat_template_kwargs` reach the template as variables and nothing else: they cannot name
a template, replace the messages or the tools, or redefine a special token. Rendering
stops with a `ValueError` once the text passes `max_chars` (a prompt that long cannot fit
the context anyway), so no template builds unbounded text from what a client sends.
The environment matches what `transformers.apply_chat_template` gives templates
(`tojson` without HTML escaping, `raise_exception`, `strftime_now`, loop controls, the
`{% generation %}` tag), so a model's template renders here as it does there.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# what the server itself passes the template, and the template itself (fixed at start-up):
# a client's variables may not name these
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "chat_template"})
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by templates that mark assistant
    text for training masks) renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatRenderer:
    """One compiled chat template. `render` is safe to call from several threads."""

    def __init__(self, template: str, special_tokens: dict[str, str], max_chars: int) -> None:
        """Raises `ValueError` if `template` is not valid Jinja."""
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self.template = env.from_string(template)
            self.free_variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template is not valid Jinja: {e}") from None
        self.source = template
        self.special_tokens = special_tokens
        self.max_chars = max_chars

    @classmethod
    def for_model(cls, tokenizer: Any, override: str | None, max_chars: int) -> ChatRenderer | None:
        """The model's template, or the file `override` names; None if neither exists."""
        template = Path(override).read_text() if override is not None else getattr(tokenizer, "chat_template", None)
        if not template:
            return None
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()))
        tokens = {name: value for name in SPECIAL_TOKENS if isinstance(value := getattr(tokenizer, name, None), str)}
        return cls(template, tokens, max_chars)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               variables: dict[str, Any] | None, *, add_generation_prompt: bool = True,
               continue_final: bool = False) -> str:
        """The conversation, with a generation prompt if `add_generation_prompt`; with
        `continue_final`, cut right after the last message's content so the model goes on
        writing it. Raises `ValueError` for a variable that would replace what the server
        passes, a template error, text past `max_chars`, or a last message whose content
        the template does not write as it is."""
        variables = variables or {}
        taken = [k for k in variables if k in RESERVED or k in SPECIAL_TOKENS]
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {taken[0]!r}: the server sets it "
                             "(the template is fixed at start-up: --chat-template)")
        context = {**self.special_tokens, **variables, "messages": messages, "tools": tools,
                   "add_generation_prompt": add_generation_prompt}
        parts, size = [], 0
        try:
            for part in self.template.generate(**context):
                size += len(part)
                if size > self.max_chars:
                    raise ValueError(f"the chat renders to more than {self.max_chars} characters")
                parts.append(part)
        except (jinja2.TemplateError, TypeError, RecursionError) as e:
            raise ValueError(f"cannot apply the chat template: {e}") from None
        text = "".join(parts)
        return _cut_after(text, messages[-1].get("content") or "") if continue_final else text


def _cut_after(text: str, content: str) -> str:
    """`text` up to the end of the last occurrence of `content` (or of it stripped, as
    templates often trim messages)."""
    for wanted in (content, content.strip()):
        at = text.rfind(wanted) if wanted else -1
        if at >= 0:
            return text[: at + len(wanted)]
    raise ValueError("cannot continue the final message: it is empty, or the chat template does not "
                     "write its content as it is")
