"""What a speculative step costs, and how many drafts a step should verify.

A step with drafts is one target pass over every request's pending token and drafts (a
verification pass of N tokens), after the draft model's decode steps if there is one; a
step without drafts is the plain decode pass. `PassCosts` models each as linear in its
size, and `draft_cap` picks the per-request cap on drafts that makes the most expected
tokens per millisecond, 0 (plain decoding) unless drafting is expected to be faster.

The costs are measured when the engine starts (`calibrate`: uniform shapes, unshared
contexts, no sampling) and then corrected by the passes the scheduler times as it runs:
each line is scaled by a running average of how long the passes it predicted really took
(`Scales`), which counts what calibration does not see (sampling rows, requests of mixed
shapes, shared prefixes). Given costs (`--speculative-pass-costs`) are used as they are,
so the choice of drafts is a pure function of the running requests' state and a run
replays exactly. Drafting never changes a request's tokens (`accept`), only how many
target passes they take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

FIELDS = ("decode fixed", "decode per request", "verify fixed", "verify per request", "verify per token",
          "draft fixed", "draft per request")
MIN_SPEEDUP = 1.05  # drafting must be expected this much faster than the plain pass
SCALE_DECAY = 0.9  # weight of the past in a line's running correction


@dataclass(frozen=True)
class Line:
    """`fixed + slope * x` milliseconds."""

    fixed: float
    slope: float

    def at(self, x: float) -> float:
        return self.fixed + self.slope * x


@dataclass(frozen=True)
class Plane:
    """`fixed + per_request * B + per_token * N` milliseconds."""

    fixed: float
    per_request: float
    per_token: float

    def at(self, requests: float, tokens: float) -> float:
        return self.fixed + self.per_request * requests + self.per_token * tokens


@dataclass(frozen=True)
class PassCosts:
    """Milliseconds of a target decode pass of B requests (`decode`, x = B), of a target
    verification pass of B requests and N tokens (`verify`: off the decode path, a
    request's cost depends on more than its tokens) and of one decode step of the draft
    model over B requests (`draft`, x = B; zero for drafters without a model)."""

    decode: Line
    verify: Plane
    draft: Line

    @classmethod
    def parse(cls, text: str) -> PassCosts:
        """Seven comma-separated non-negative numbers, in the order of `FIELDS` (the form
        `str` writes and the engine logs)."""
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            values = []
        if len(values) != len(FIELDS) or not all(v >= 0 for v in values):
            raise ValueError(f"speculative_pass_costs must be {len(FIELDS)} comma-separated non-negative "
                             f"milliseconds ({', '.join(FIELDS)}), got {text!r}")
        return cls(Line(*values[0:2]), Plane(*values[2:5]), Line(*values[5:7]))

    def scaled(self, scales: Scales) -> PassCosts:
        v, k = self.verify, scales.verify
        return PassCosts(Line(self.decode.fixed * scales.decode, self.decode.slope * scales.decode),
                         Plane(v.fixed * k, v.per_request * k, v.per_token * k),
                         Line(self.draft.fixed * scales.draft, self.draft.slope * scales.draft))

    def describe(self) -> str:
        """The costs in words, for the logs."""
        return (f"decode {self.decode.fixed:.3g} ms + {self.decode.slope:.3g} ms a request, verification "
                f"{self.verify.fixed:.3g} ms + {self.verify.per_request:.3g} ms a request + "
                f"{self.verify.per_token:.3g} ms a token, draft step {self.draft.fixed:.3g} ms + "
                f"{self.draft.slope:.3g} ms a request")

    def __str__(self) -> str:
        values = (self.decode.fixed, self.decode.slope, self.verify.fixed, self.verify.per_request,
                  self.verify.per_token, self.draft.fixed, self.draft.slope)
        return ",".join(f"{v:.4g}" for v in values)


@dataclass
class Scales:
    """Running averages of measured / predicted time, per line of `PassCosts`."""

    decode: float = 1.0
    verify: float = 1.0
    draft: float = 1.0

    def observe(self, line: str, predicted_ms: float, measured_ms: float) -> None:
        ratio = measured_ms / max(predicted_ms, 1e-6)
        setattr(self, line, SCALE_DECAY * getattr(self, line) + (1 - SCALE_DECAY) * ratio)


def draft_cap(costs: PassCosts, sizes: Sequence[int], expected: Sequence[Callable[[int], float]],
              model_steps: bool) -> int:
    """The cap K on each request's drafts (request i verifies `min(sizes[i], K)`) that
    makes the most expected tokens per millisecond, or 0 where none beats the plain pass
    by `MIN_SPEEDUP`. `expected[i](n)`: tokens n drafts of request i are expected to
    add; `model_steps`: drafting K tokens runs K draft-model decode steps (over the
    requests still drafting at each)."""
    batch = len(sizes)
    plain = batch / max(costs.decode.at(batch), 1e-9)
    best, best_rate = 0, plain * MIN_SPEEDUP
    gains = [[e(n) for n in range(size + 1)] for e, size in zip(expected, sizes, strict=True)]
    drafting = [sum(1 for n in sizes if n > j) for j in range(max(sizes, default=0))]  # requests at draft step j
    steps_ms = 0.0
    for cap in range(1, max(sizes, default=0) + 1):
        ns = [min(n, cap) for n in sizes]
        tokens = batch + sum(g[n] for g, n in zip(gains, ns, strict=True))
        if model_steps:
            steps_ms += costs.draft.at(drafting[cap - 1])
        ms = costs.verify.at(batch, batch + sum(ns)) + steps_ms
        if tokens / max(ms, 1e-9) > best_rate:
            best, best_rate = cap, tokens / max(ms, 1e-9)
    return best


def branch_gain(rate: float, depth: int, length: int, draft: int) -> float:
    """Tokens an alternative path of `length` tokens, which leaves a draft of `draft`
    tokens after `depth` shared ones, is expected to add when drafts are kept at `rate`:
    it is followed only if the shared tokens were kept and the draft's next was not (or
    the draft ended there), and is then kept token by token like a draft."""
    leave = rate**depth * ((1 - rate) if depth < draft else 1.0)
    return leave * sum(rate ** (i + 1) for i in range(length - depth))


def widen(costs: PassCosts, sequences: int, tokens: int, expected: float,
          candidates: Sequence[tuple[float, int]]) -> list[int]:
    """Which `candidates` (expected tokens gained, tokens verified), each one more sequence
    of a verification pass of `sequences` sequences and `tokens` tokens expected to emit
    `expected` tokens, to verify too: best gain per token first, each while it raises the
    expected tokens per millisecond. Indices, ascending."""
    ms = costs.verify.at(sequences, tokens)
    chosen = []
    for i in sorted(range(len(candidates)), key=lambda i: -candidates[i][0] / candidates[i][1]):
        gain, n = candidates[i]
        more = costs.verify.at(sequences + 1, tokens + n)
        if (expected + gain) / max(more, 1e-9) <= expected / max(ms, 1e-9):
            break
        chosen.append(i)
        sequences, tokens, expected, ms = sequences + 1, tokens + n, expected + gain, more
    return sorted(chosen)


def line_through(x0: float, y0: float, x1: float, y1: float) -> Line:
    """The line through two measurements, its slope and intercept kept non-negative."""
    slope = max(0.0, (y1 - y0) / (x1 - x0))
    return Line(max(0.0, y0 - slope * x0), slope)
