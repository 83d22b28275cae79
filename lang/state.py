"""What a program holds as `s`: a `ProgramState`, and the group `s.fork(n)` returns."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

from sprig.cost import Cost
from sprig.executor import StreamExecutor, user_site
from sprig.ir import Expr, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, as_expr


class _Scope:
    """`with s.user():` / `with s.var_scope(name):` — queue `begin` on entry and `end`
    on a normal exit (a raising body leaves the scope open, as the program failed)."""

    def __init__(self, state: ProgramState, begin: Expr, end: Expr) -> None:
        self._state, self._begin, self._end = state, begin, end

    def __enter__(self) -> None:
        self._state._submit(self._begin)

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self._state._submit(self._end)


class ProgramState:
    """A program's state: `s += expr` queues an expression; reads wait for results.

    `ret_value` is what the program function returned. `program_thread` is set for a
    streamed run, whose function runs on its own thread; `sync` then waits for it too.
    """

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None
        self.program_thread: threading.Thread | None = None

    def _submit(self, expr: Expr) -> None:
        self.stream_executor.submit(expr, user_site())

    def __iadd__(self, other: Expr | str) -> ProgramState:
        if other is None:
            raise ValueError("tried to append None to a program state")
        self._submit(as_expr(other))
        return self

    def _role(self, role: str, expr: Expr | str | None) -> _Scope | Expr:
        if expr is None:
            return _Scope(self, RoleBegin(role), RoleEnd(role))
        full = RoleBegin(role) + as_expr(expr) + RoleEnd(role)
        self._submit(full)
        return full

    def system(self, expr: Expr | str | None = None) -> _Scope | Expr:
        """Append a system message, or with no argument a `with` scope for one."""
        return self._role("system", expr)

    def user(self, expr: Expr | str | None = None) -> _Scope | Expr:
        return self._role("user", expr)

    def assistant(self, expr: Expr | str | None = None) -> _Scope | Expr:
        return self._role("assistant", expr)

    def var_scope(self, name: str) -> _Scope:
        """`with s.var_scope("x"):` binds `s["x"]` to the text appended inside."""
        return _Scope(self, VarScopeBegin(name), VarScopeEnd(name))

    def fork(self, size: int = 1) -> ProgramStateGroup:
        children = self.stream_executor.fork(int(size), user_site())
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    def sync(self) -> None:
        thread = self.program_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
            self.stream_executor.wait_finished()
        self.stream_executor.sync()

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, Any]]:
        """The finished chat messages in OpenAI format (a message with images has a list
        of content parts)."""
        self.sync()
        return copy.deepcopy(self.stream_executor.messages_)

    def cost(self) -> Cost:
        """What every model call of this state and its forks has cost so far."""
        self.sync()
        return self.stream_executor.ledger.total

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The server's meta_info of the gen or select that bound `name`."""
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or variable `var_name`) piece by piece as a streamed run produces
        it; for a run without `stream=True`, the finished value in one piece."""
        yield from self._pieces(var_name, False)

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """`text_iter` for asyncio (waits in a worker thread). With `return_meta_data`,
        `(piece, meta_info)` pairs: the meta_info of `var_name` as of that piece, whose
        `output_token_logprobs` / `output_top_logprobs` hold only the piece's new entries
        while `completion_tokens` and `output_token_logprobs_length` count them all so far
        (SGLang's form; meta_info is None without `var_name`)."""
        loop = asyncio.get_running_loop()
        pieces, end = self._pieces(var_name, return_meta_data), object()
        while (item := await loop.run_in_executor(None, next, pieces, end)) is not end:
            yield item

    def _pieces(self, var_name: str | None, with_meta: bool) -> Iterator[Any]:
        if self.stream_executor.stream:
            yield from self.stream_executor.iter_text(var_name, with_meta=with_meta)
            return
        text = self.text() if var_name is None else str(self.get_var(var_name))
        meta = self.get_meta_info(var_name) if var_name is not None else None
        yield (text, meta) if with_meta else text

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.stream_executor.variables

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The children of `s.fork(n)`. `forks += expr` appends to every child (`expr` may
    also be a list with one item per child, or a function of the child's index)."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        """`forks[i] += expr` stores the child back in its place; no other state may be."""
        if value is not self.states[i]:
            raise ValueError("a fork's state cannot be replaced; append to it with forks[i] += ...")

    def __iadd__(
        self, other: Expr | str | Sequence[Expr | str] | Callable[[int], Expr | str]
    ) -> ProgramStateGroup:
        for i, state in enumerate(self.states):
            if callable(other):
                state += other(i)
            elif isinstance(other, (list, tuple)):
                state += other[i]
            else:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every child, then give the parent each variable the children bound
        after the fork as a list, one item per child in order; the children end."""
        if mode != "gather_variable":
            raise ValueError(f"join mode {mode!r} is not supported; use 'gather_variable'")
        parent = self.parent.stream_executor
        before = set(parent.variables)
        gathered: dict[str, list[Any]] = {}
        for state in self.states:
            state.stream_executor.sync()
            for name, value in state.stream_executor.variables.items():
                if name not in before:
                    gathered.setdefault(name, []).append(value)
        for name, values in gathered.items():
            parent.set_var(name, values)
        for state in self.states:
            state.stream_executor.end()
