"""A constraint that starts at a trigger: the output is free until it writes the trigger
text (`SamplingParams.constraint_trigger`, e.g. `<tool_call>`), and the text after the
trigger must match the request's grammar. That is how a chat answer in `tool_choice`
"auto" may be plain content, yet a tool call, once begun, is a well-formed call of one of
the request's tools (llama.cpp's lazy grammars do the same).

Phases of one request's output:
- `FREE`: any token, stop tokens included (an answer without a call may end anywhere);
  the text is watched for the trigger;
- `CONSTRAINED`: the grammar itself, from the text after the trigger on;
- `STOPPED`: a stop token ended the output while it was free.

The trigger is found in the decoded text of the last few tokens, so it may span tokens;
text after it in the same token is fed to the grammar. Special tokens write no text there
(as the answer's text is decoded): one whose name is the trigger is the trigger, any other
is free output. A token whose text completes the
trigger and runs on with text the grammar refuses is masked out while free, so every
token the mask allows is accepted. The phase depends only on the request's own tokens
(batch invariance).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch

from sprig.runtime.constrained import Grammar
from sprig.runtime.scheduler.gate import Gate, set_bits
from sprig.runtime.scheduler.marker import Marker


class Phase(Enum):
    FREE = "free"
    CONSTRAINED = "constrained"
    STOPPED = "stopped"


class TriggerGate(Gate):
    """Wraps a request's grammar matcher (see the module docstring); every `Grammar`
    invariant holds for the wrapped grammar once the trigger is written, and `rollback`
    undoes tokens of any phase."""

    grammar_phase = Phase.CONSTRAINED

    def __init__(self, inner: Grammar, trigger: Marker, *, stop_token_ids: Iterable[int], tokenizer: Any) -> None:
        """`trigger`: a `Marker` built with special tokens writing no text."""
        super().__init__(inner, Phase.FREE, trigger, tokenizer)
        self._stops = frozenset(stop_token_ids)

    def fill_bitmask(self, bitmask_row: torch.Tensor) -> None:
        if self.phase is Phase.CONSTRAINED:
            self.inner.fill_bitmask(bitmask_row)
            return
        bitmask_row.fill_(-1 if self.phase is Phase.FREE else 0)
        if self.phase is Phase.FREE:
            set_bits(bitmask_row, self.refused_completions(), allowed=False)

    def accept_token(self, token_id: int) -> bool:
        if self.phase is Phase.CONSTRAINED:
            return self.accept_tokens((token_id,))
        if self.phase is Phase.STOPPED:
            return False
        before = self._state()
        took = 0
        if token_id in self._stops:
            self.phase = Phase.STOPPED
        else:
            took = self._take_free(token_id)
            if took is None:
                took = 0
            elif took < 0:
                return False
            else:
                self.phase = Phase.CONSTRAINED
        self._record(token_id, before, took)
        return True

    def is_terminated(self) -> bool:
        return self.phase is not Phase.CONSTRAINED or self.inner.is_terminated()

    def is_finished(self) -> bool:
        return self.phase is Phase.STOPPED or (self.phase is Phase.CONSTRAINED and self.inner.is_finished())

    def forced_continuation(self) -> str | None:
        return self.inner.forced_continuation() if self.phase is Phase.CONSTRAINED else None
