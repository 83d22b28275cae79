"""Where a backend's chat template comes from.

`resolve_chat_template(model_info, override)` picks, first match wins:

1. `override`: a `ChatTemplate` or a registered name the user passed to the backend;
2. `model_info["chat_roles"]` (role -> [prefix, suffix]) with `default_system_prompt`
   and `stop_str`: the server's own role boundaries, used verbatim;
3. `model_info["chat_template"]`: the tokenizer's Jinja source, whose role boundaries
   (and image token) `from_jinja` derives by rendering probe conversations (needs jinja2);
4. the registry entry matching `model_info["model_path"]`, else "default".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sprig.chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path

_S, _U, _A = "SPRIGPROBESYSTEM", "SPRIGPROBEUSER", "SPRIGPROBEASSISTANT"


def resolve_chat_template(
    model_info: Mapping[str, Any], override: ChatTemplate | str | None = None
) -> ChatTemplate:
    if isinstance(override, ChatTemplate):
        return override
    if override is not None:
        return get_chat_template(override)
    if model_info.get("chat_roles"):
        return ChatTemplate.from_dict(model_info)
    source = model_info.get("chat_template")
    if source:
        try:
            return from_jinja(source, bos_token=model_info.get("bos_token"))
        except (ImportError, ValueError):
            pass
    return get_chat_template_by_model_path(str(model_info.get("model_path", "")))


def from_jinja(source: str, bos_token: str | None = None, name: str = "server") -> ChatTemplate:
    """Role boundaries of a Hugging Face Jinja chat template.

    Renders conversations whose contents are probe words and reads off the text around
    them. A template that rejects a lone system message gets empty system boundaries; a
    template that injects a system block before a lone user turn yields it as
    `default_system_prompt`. The assistant's suffix, stripped, is the stop string. The
    `image_token` is the text the template writes for an image part (`{"type": "image"}`)
    of a user message, None for a template that renders no content parts.
    Raises ValueError when the renders are not consistent with fixed role boundaries.
    """
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def fail(message: str) -> ValueError:
        return ValueError(f"cannot derive role boundaries from the chat template: {message}")

    def raise_exception(message: str) -> None:
        raise fail(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)

    def render(*turns: tuple[str, Any], prompt: bool = False) -> str:
        messages = [{"role": r, "content": c} for r, c in turns]
        try:
            text = template.render(
                messages=messages, add_generation_prompt=prompt,
                bos_token=bos_token or "", eos_token="",
            )
        except TemplateError as e:
            raise fail(str(e)) from e
        return text[len(bos_token):] if bos_token and text.startswith(bos_token) else text

    def split(text: str, *probes: str) -> list[str]:
        parts = []
        for probe in probes:
            head, found, text = text.partition(probe)
            if not found:
                raise fail(f"probe {probe!r} not rendered")
            parts.append(head)
        return [*parts, text]

    def after(text: str, known: str) -> str:
        if not text.startswith(known):
            raise fail(f"{text!r} does not start with {known!r}")
        return text[len(known):]

    try:
        sys_prefix, sys_suffix = split(render(("system", _S)), _S)
        system: tuple[tuple[str, str], ...] = (("system", _S),)
    except ValueError:
        sys_prefix = sys_suffix = ""
        system = ()
    if system:
        _, between, user_suffix = split(render(*system, ("user", _U)), _S, _U)
        user_prefix = after(between, sys_suffix)
    else:
        user_prefix, user_suffix = split(render(("user", _U)), _U)
    prompted = split(render(*system, ("user", _U), prompt=True), _U)[-1]
    assistant_prefix = after(prompted, user_suffix)
    assistant_suffix = split(render(*system, ("user", _U), ("assistant", _A)), _A)[-1]

    default_system = None
    lone_user_head = split(render(("user", _U)), _U)[0]
    if system and lone_user_head != user_prefix and lone_user_head.endswith(user_prefix):
        block = after(lone_user_head[: len(lone_user_head) - len(user_prefix)], sys_prefix)
        if block.endswith(sys_suffix):
            default_system = block[: len(block) - len(sys_suffix)]
    return ChatTemplate(
        name=name,
        roles={
            "system": (sys_prefix, sys_suffix),
            "user": (user_prefix, user_suffix),
            "assistant": (assistant_prefix, assistant_suffix),
        },
        default_system_prompt=default_system,
        stop_str=(assistant_suffix.strip(),) if assistant_suffix.strip() else (),
        image_token=_image_token(lambda content: render(("user", content))),
    )


def _image_token(render_user: Callable[[Any], str]) -> str | None:
    """What a template writes for an image part of a lone user message, found as the text
    an image part inserts between two text parts; None when the template renders content
    parts other than as it renders the same text given as a string."""
    text = [{"type": "text", "text": _U}]
    try:
        if render_user(text) != render_user(_U):
            return None
        plain = render_user([*text, {"type": "text", "text": _A}])
        shown = render_user([*text, {"type": "image"}, {"type": "text", "text": _A}])
    except Exception:  # a template written for string contents fails on parts in its own ways
        return None
    return _inserted(plain, shown)


def _inserted(before: str, after: str) -> str | None:
    """The text that `after` inserts at one place into `before`; None if it is not that."""
    if len(after) <= len(before):
        return None
    head = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(before))
    tail = 0
    while tail < len(before) - head and before[-1 - tail] == after[-1 - tail]:
        tail += 1
    if head + tail != len(before):
        return None
    return after[head:len(after) - tail]
