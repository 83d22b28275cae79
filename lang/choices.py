"""How `select` turns the logprobs of each choice's tokens into a decision.

A token entry is SGLang's `[logprob, token_id, text]` (id and text may be None). The
backend hands each method the entries of every choice's own tokens, conditioned on the
prefix, and — when `requires_unconditional_logprobs` — the same tokens scored without
the prefix, whose first logprob is None (nothing precedes it) and counts as 0.
A method's signature is SGLang's, so a custom SGLang method ports unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TokenEntry = Sequence[Any]  # [logprob | None, token_id | None, text | None]
Entries = list[list[TokenEntry]]  # one list of entries per choice


@dataclass(frozen=True)
class ChoicesDecision:
    """The chosen string and the scores that chose it."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def mean_logprob(entries: Sequence[TokenEntry]) -> float:
    """Mean logprob over entries with a logprob (None entries are skipped)."""
    values = [e[0] for e in entries if e[0] is not None]
    if not values:
        raise ValueError("a choice has no scored tokens of its own")
    return sum(values) / len(values)


def _argmax_first(values: Sequence[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


class ChoicesSamplingMethod(ABC):
    """Pick one of the choices from their token logprobs (every list is per choice).

    `__call__` has SGLang's keyword signature (a custom SGLang method that overrides it
    ports unchanged); the built-in methods implement `pick` instead.
    """

    requires_unconditional_logprobs: bool = False

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: Entries,
        output_token_logprobs: Entries,
        unconditional_token_logprobs: Entries | None = None,
    ) -> ChoicesDecision:
        index, extra = self.pick(
            normalized_prompt_logprobs, input_token_logprobs, unconditional_token_logprobs
        )
        meta = {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            **extra,
        }
        return ChoicesDecision(choices[index], meta)

    @abstractmethod
    def pick(
        self, normalized: list[float], conditional: Entries, unconditional: Entries | None
    ) -> tuple[int, dict[str, Any]]:
        """The index of the chosen choice and the extra scores to report."""

    def __repr__(self) -> str:
        return type(self).__name__


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (SGLang's default)."""

    def pick(
        self, normalized: list[float], conditional: Entries, unconditional: Entries | None
    ) -> tuple[int, dict[str, Any]]:
        return _argmax_first(normalized), {}


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Eliminate choices token by token, keeping those with the best logprob at each
    position; a choice shorter than the longest is padded with its own mean logprob.
    Ties that survive every position go to the earliest choice."""

    def pick(
        self, normalized: list[float], conditional: Entries, unconditional: Entries | None
    ) -> tuple[int, dict[str, Any]]:
        width = max(len(entries) for entries in conditional)
        matrix = []
        for entries in conditional:
            row = [e[0] for e in entries]
            matrix.append(row + [mean_logprob(entries)] * (width - len(row)))
        alive = list(range(len(conditional)))
        for column in range(width):
            top = max(matrix[i][column] for i in alive)
            alive = [i for i in alive if matrix[i][column] == top]
            if len(alive) == 1:
                break
        return alive[0], {"greedy_logprob_matrix": matrix}


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (conditional - unconditional) token logprob:
    how much the prefix raises the choice's likelihood over the choice alone."""

    requires_unconditional_logprobs = True

    def pick(
        self, normalized: list[float], conditional: Entries, unconditional: Entries | None
    ) -> tuple[int, dict[str, Any]]:
        if unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for cond, uncond in zip(conditional, unconditional, strict=True):
            if len(cond) != len(uncond):
                raise ValueError(
                    f"a choice has {len(cond)} tokens after the prefix but {len(uncond)} "
                    "alone; the tokenization differs at the boundary"
                )
            diffs = [c[0] - (u[0] or 0.0) for c, u in zip(cond, uncond, strict=True)]
            scores.append(sum(diffs) / len(diffs))
        return _argmax_first(scores), {
            "unconditional_token_logprobs": unconditional,
            "normalized_unconditional_prompt_logprobs": scores,
        }


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
