"""The interface between the interpreter and a model: what a backend must do.

A backend sees a program state only as a `Prompt` (its text, finished chat messages, the
open role and the images) and answers with frozen results that carry the `Cost` of the
requests it made. Every method may be called from many threads at once.

`select` is implemented here once for all backends: a backend supplies the logprobs of
each choice's own tokens (`score_choices`) and the method picks from them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sprig.chat_template import ChatTemplate
from sprig.choices import ChoicesSamplingMethod, TokenEntry, mean_logprob
from sprig.cost import Cost
from sprig.images import ImageData
from sprig.sampling import GenParams


@dataclass(frozen=True)
class Prompt:
    """A program state at the moment of a call.

    `text` is always the full context. `messages` are the finished messages (OpenAI
    format; a message with images has a list of content parts, its images as `image_url`
    parts where they stood); `open_role` is the role begun and not yet ended (None
    outside roles) and `open_role_text` the text appended inside it after its prefix.
    `images` are the state's images in the order of their image tokens in `text`, one
    per token.
    """

    text: str
    messages: tuple[dict[str, Any], ...] = ()
    open_role: str | None = None
    open_role_text: str = ""
    images: tuple[ImageData, ...] = ()

    @property
    def uses_roles(self) -> bool:
        return bool(self.messages) or self.open_role is not None


@dataclass(frozen=True)
class Generation:
    """Generated text (a tuple of texts when `n > 1`), the server's meta_info (a tuple,
    one per text, when `n > 1`), and what the request cost."""

    text: str | tuple[str, ...]
    meta: dict[str, Any] | tuple[dict[str, Any], ...]
    cost: Cost


STREAMED_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


@dataclass(frozen=True)
class StreamChunk:
    """A piece of a streamed generation. `meta` and `cost` are cumulative: the last
    chunk's are those of the whole request (a backend whose server streams only each
    event's new logprob entries, `STREAMED_LOGPROB_KEYS`, gathers them)."""

    text: str
    meta: dict[str, Any]
    cost: Cost


@dataclass(frozen=True)
class ChoiceLogprobs:
    """Per choice, the entries of its own tokens after the prefix (`conditional`) and,
    when asked for, the same tokens scored alone (`unconditional`, first logprob None)."""

    conditional: list[list[TokenEntry]]
    unconditional: list[list[TokenEntry]] | None
    cost: Cost


@dataclass(frozen=True)
class Selection:
    """The chosen string, the scores behind it (SGLang's select meta_info) and the cost."""

    decision: str
    meta: dict[str, Any]
    cost: Cost


class Backend(ABC):
    """A model behind the language. Subclasses set `chat_template`."""

    chat_template: ChatTemplate

    @abstractmethod
    def generate(self, prompt: Prompt, params: GenParams) -> Generation:
        """Continue `prompt.text` (or its messages) under `params` (dtype still set)."""

    @abstractmethod
    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[StreamChunk]:
        """`generate` as pieces in order; their texts concatenate to the generation."""

    @abstractmethod
    def score_choices(
        self, prompt: Prompt, choices: Sequence[str], unconditional: bool
    ) -> ChoiceLogprobs:
        """Token logprobs of each `prompt.text + choice`, restricted to the choice."""

    def commit(self, prompt: Prompt) -> Cost:
        """Cache `prompt.text` so that requests extending it reuse its KV. A backend
        without an explicit cache does nothing."""
        return Cost()

    def select(
        self, prompt: Prompt, choices: Sequence[str], method: ChoicesSamplingMethod
    ) -> Selection:
        scored = self.score_choices(prompt, choices, method.requires_unconditional_logprobs)
        decision = method(
            choices=list(choices),
            normalized_prompt_logprobs=[mean_logprob(e) for e in scored.conditional],
            input_token_logprobs=scored.conditional,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=scored.unconditional,
        )
        return Selection(decision.decision, decision.meta_info, scored.cost)

    def get_model_name(self) -> str:
        return type(self).__name__


_default_backend: Any = None


def set_default_backend(backend: Any) -> None:
    """The backend programs use when `run` is given none (a `Backend` or a `Runtime`)."""
    global _default_backend
    _default_backend = backend


def resolve_backend(backend: Any = None) -> Backend:
    """`backend` (else the default), or the `.endpoint` of a launcher such as `Runtime`."""
    chosen = _default_backend if backend is None else backend
    chosen = getattr(chosen, "endpoint", chosen)
    if not isinstance(chosen, Backend):
        raise ValueError(
            "no backend: pass backend= to run(), or call sprig.set_default_backend(...) first"
        )
    return chosen
