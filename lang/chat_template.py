"""Chat templates as role boundaries: the text before and after each role's content.

A program renders `s += user("hi")` as `prefix(user) + "hi" + suffix(user)`, so a
template is the (prefix, suffix) pair of every role, the system prompt the model expects
when a conversation does not start with one, the stop strings that end a turn, and the
text that stands for an image (`sgl.image`) in a model's prompt.
Where a backend's template comes from is `resolve_chat_template`'s job; this module
holds the type and a registry of common formats chosen by model path, with "default"
for anything unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    """Role boundaries of one chat format.

    Invariant: `roles` maps each of system/user/assistant to a (prefix, suffix) pair.
    `merge_system_into_user` is the Llama-2 layout, where the system block sits inside
    the first user turn. `image_token` is the text that stands for one image in a prompt
    (what the model's server expands into the image's tokens); None for a format that
    takes no images, where `sgl.image` is an error.
    """

    name: str
    roles: Mapping[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    merge_system_into_user: bool = False
    image_token: str | None = None

    def __post_init__(self) -> None:
        missing = [r for r in ROLES if r not in self.roles]
        if missing:
            raise ValueError(f"chat template {self.name!r} lacks roles {missing}")
        object.__setattr__(self, "roles", {r: tuple(self.roles[r]) for r in self.roles})
        object.__setattr__(self, "stop_str", tuple(self.stop_str))

    def get_prefix_and_suffix(self, role: str, history: list[dict[str, Any]]) -> tuple[str, str]:
        """The text around a `role` message that follows the finished messages `history`."""
        prefix, suffix = self.roles[role]
        if self.merge_system_into_user:
            if role == "system" and not history:
                return self.roles["user"][0] + prefix, suffix
            if role == "user" and len(history) == 1 and history[0]["role"] == "system":
                return "", suffix
        return prefix, suffix

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The text of a whole conversation."""
        out = []
        for i, message in enumerate(messages):
            prefix, suffix = self.get_prefix_and_suffix(message["role"], messages[:i])
            out.append(f"{prefix}{message['content']}{suffix}")
        return "".join(out)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a server may send as `chat_roles` & co. (see `from_dict`)."""
        return {
            "name": self.name,
            "chat_roles": {r: list(p) for r, p in self.roles.items()},
            "default_system_prompt": self.default_system_prompt,
            "stop_str": list(self.stop_str),
            "image_token": self.image_token,
        }

    @classmethod
    def from_dict(cls, info: Mapping[str, Any], name: str = "server") -> ChatTemplate:
        """A template from `chat_roles` (role -> [prefix, suffix]), `default_system_prompt`,
        `stop_str` and `image_token` fields, as in a server's `/get_model_info`."""
        return cls(
            name=str(info.get("name") or name),
            roles={r: (str(p[0]), str(p[1])) for r, p in info["chat_roles"].items()},
            default_system_prompt=info.get("default_system_prompt"),
            stop_str=tuple(info.get("stop_str") or ()),
            image_token=info.get("image_token"),
        )


_REGISTRY: dict[str, ChatTemplate] = {}
_MATCHERS: list[tuple[Callable[[str], bool], str]] = []


def register_chat_template(template: ChatTemplate) -> ChatTemplate:
    _REGISTRY[template.name] = template
    return template


def register_model_match(predicate: Callable[[str], bool], name: str) -> None:
    """Use template `name` for model paths where `predicate(path.lower())` holds;
    the earliest registered match wins."""
    _MATCHERS.append((predicate, name))


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no chat template {name!r}; registered: {sorted(_REGISTRY)}") from None


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    path = model_path.lower()
    for predicate, name in _MATCHERS:
        if predicate(path):
            return _REGISTRY[name]
    return _REGISTRY["default"]


def _chatml_roles() -> dict[str, tuple[str, str]]:
    return {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}


def _llama3_roles(start: str, end: str, eot: str) -> dict[str, tuple[str, str]]:
    return {r: (f"{start}{r}{end}\n\n", eot) for r in ROLES}


for _template in (
    ChatTemplate("default", {r: (f"{r.upper()}:", "\n") for r in ROLES}),
    ChatTemplate("chatml", _chatml_roles(), stop_str=("<|im_end|>",)),
    ChatTemplate(
        "qwen", _chatml_roles(), default_system_prompt="You are a helpful assistant.",
        stop_str=("<|im_end|>",),
    ),
    ChatTemplate(
        "llama-2-chat",
        {"system": ("<<SYS>>\n", "\n<</SYS>>\n\n"), "user": ("[INST] ", " [/INST]"),
         "assistant": ("", " </s><s>")},
        merge_system_into_user=True,
    ),
    ChatTemplate(
        "llama-3-instruct",
        _llama3_roles("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        stop_str=("<|eot_id|>",),
    ),
    ChatTemplate(
        "gemma-it",
        {"system": ("", ""), "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
         "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n")},
        stop_str=("<end_of_turn>",), image_token="<start_of_image>",
    ),
    ChatTemplate(
        "deepseek-v3",
        {"system": ("", ""), "user": ("<｜User｜>", ""),
         "assistant": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")},
        stop_str=("<｜end▁of▁sentence｜>",),
    ),
):
    register_chat_template(_template)

register_model_match(lambda p: "deepseek-v3" in p or "deepseek-r1" in p, "deepseek-v3")
register_model_match(lambda p: "llama-2" in p and "chat" in p, "llama-2-chat")
register_model_match(lambda p: ("mistral" in p or "mixtral" in p) and "instruct" in p, "llama-2-chat")
register_model_match(lambda p: "llama-3" in p and "instruct" in p, "llama-3-instruct")
register_model_match(lambda p: "gemma" in p and "-it" in p, "gemma-it")
register_model_match(lambda p: "qwen" in p and ("chat" in p or "instruct" in p), "qwen")
register_model_match(lambda p: "chatml" in p or "hermes" in p, "chatml")
