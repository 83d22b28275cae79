"""The expressions a program appends to its state with `s += ...`.

Expressions are immutable values; `a + b` (either may be a str) builds an `ExprList`
that executes its items in order. The executor gives each its meaning: constants are
appended, a `Gen`/`Select` calls the backend and binds its `name`, role markers render
through the chat template, an `Image` appends the template's image token and records the
image, `CommitLazy` caches the state's text on the server.
"""

from __future__ import annotations

from dataclasses import dataclass

from sprig.choices import ChoicesSamplingMethod
from sprig.reasoning import ReasoningFormat, reasoning_name
from sprig.sampling import GenParams


class Expr:
    """Base of every expression; supports `+` with other expressions and strings."""

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList((*_items(self), *_items(as_expr(other))))

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList((*_items(as_expr(other)), *_items(self)))


def as_expr(value: Expr | str) -> Expr:
    """`value` as an expression: a str becomes a `Constant`."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    raise TypeError(f"a program state takes str or sprig expressions, not {type(value).__name__}")


def _items(expr: Expr) -> tuple[Expr, ...]:
    return expr.items if isinstance(expr, ExprList) else (expr,)


def bound_names(expr: Expr) -> list[str]:
    """Names of the variables that executing `expr` binds, in order (a name bound twice,
    as `SeparateReasoning` rebinds its gens, counts twice)."""
    if isinstance(expr, ExprList):
        return [n for item in expr.items for n in bound_names(item)]
    if isinstance(expr, SeparateReasoning):
        return [n for name in expr.names for n in (name, reasoning_name(name))]
    name = getattr(expr, "name", None)
    return [name] if isinstance(expr, (Gen, Select, VarScopeEnd)) and name is not None else []


def generated_names(expr: Expr) -> list[str]:
    """Names bound by the gens and selects in `expr`."""
    if isinstance(expr, ExprList):
        return [n for item in expr.items for n in generated_names(item)]
    return [expr.name] if isinstance(expr, (Gen, Select)) and expr.name is not None else []


@dataclass(frozen=True)
class Constant(Expr):
    value: str


@dataclass(frozen=True)
class ExprList(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text; `name` (if any) binds the text — a list of texts when `n > 1` —
    parsed to `params.dtype` when one is set."""

    name: str | None
    params: GenParams


@dataclass(frozen=True)
class Select(Expr):
    """Append the choice the backend scores best under `method`; `name` binds it."""

    name: str | None
    choices: tuple[str, ...]
    method: ChoicesSamplingMethod


@dataclass(frozen=True)
class Image(Expr):
    """Append the chat template's `image_token` and record the image `source` (a file
    path, read when the expression runs; a URL; or the image file's bytes) for every
    later model call of the state and its forks."""

    source: str | bytes


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    """Binds `name` to the text appended since the matching `VarScopeBegin`."""

    name: str


@dataclass(frozen=True)
class SeparateReasoning(Expr):
    """Split what the gens or selects `names` generated into reasoning and answer: each
    name is rebound to its answer, `<name>_reasoning_content` to its reasoning, and the
    state's text keeps the answer only (a streamed run's text, already sent, is kept)."""

    names: tuple[str, ...]
    format: ReasoningFormat


@dataclass(frozen=True)
class CommitLazy(Expr):
    """Cache the state's text on the server (a fork does this before branching)."""
