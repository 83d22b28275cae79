"""`@function` programs: `run`, `run_batch` and `bind`.

A run executes the function with a fresh `ProgramState`. Without `stream` the function
runs in the caller's thread and `run` returns once every model call has finished, so an
error in the program — its own code or a model call — raises from `run` with the
program's line in the traceback. With `stream=True` the function runs on its own thread
and `run` returns at once; `text_iter` and `sync` raise its error.

Keyword arguments of `run` that name a parameter of the function go to the function;
the other sampling names (`max_new_tokens`, `temperature`, ...) are defaults for every
gen of the run; anything else is an error.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from sprig.backend.base import resolve_backend
from sprig.executor import StreamExecutor
from sprig.sampling import GenParams
from sprig.state import ProgramState

_RUN_DEFAULTS = GenParams(max_new_tokens=128)
_SAMPLING_NAMES = frozenset(GenParams.field_names()) - {"dtype", "regex", "json_schema", "n"}


class Program:
    """A program: a function whose first parameter is the state, plus bound arguments."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None) -> None:
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"{func.__name__} must take the program state as its first argument")
        self.func = func
        self.arg_names = [p.name for p in params[1:]]
        self._takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        self._required = [p.name for p in params[1:] if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Program:
        """A copy of this program with some arguments fixed."""
        unknown = [k for k in kwargs if k not in self.arg_names and not self._takes_any]
        if unknown:
            raise TypeError(f"{self.__name__} has no parameters {unknown}")
        return Program(self.func, {**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], GenParams]:
        program_kwargs, sampling = {}, {}
        for key, value in kwargs.items():
            if key in _SAMPLING_NAMES and key not in self.arg_names:
                sampling[key] = value
            else:
                program_kwargs[key] = value
        return {**self.bind_arguments, **program_kwargs}, _RUN_DEFAULTS.merged(GenParams(**sampling))

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run the program once and return its state (see the module docstring)."""
        program_kwargs, defaults = self._split(kwargs)
        return self._start(resolve_backend(backend), args, program_kwargs, defaults, stream)

    def _start(self, backend: Any, args: Sequence[Any], kwargs: dict[str, Any],
               defaults: GenParams, stream: bool) -> ProgramState:
        executor = StreamExecutor(backend, defaults, stream=stream)
        state = ProgramState(executor)
        if stream:
            state.program_thread = threading.Thread(
                target=self._run_streamed, args=(state, args, kwargs), name="sprig-program", daemon=True
            )
            state.program_thread.start()
            return state
        try:
            state.ret_value = self.func(state, *args, **kwargs)
        finally:
            executor.end()
        executor.wait_finished()
        return state

    def _run_streamed(self, state: ProgramState, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        try:
            state.ret_value = self.func(state, *args, **kwargs)
        except BaseException as exc:
            state.stream_executor.fail(exc)
        finally:
            state.stream_executor.end()

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run the program once per item of `batch_kwargs` (dicts of arguments, or
        sequences of positional arguments) on a thread pool; the states come back in
        input order. The error of the first failed program (in input order) is raised."""
        bad = set(sampling) - _SAMPLING_NAMES
        if bad:
            raise TypeError(f"run_batch got unknown sampling arguments {sorted(bad)}")
        items = [self._as_kwargs(item) for item in batch_kwargs]
        if not items:
            return []
        chosen = resolve_backend(backend)
        defaults = _RUN_DEFAULTS.merged(GenParams(**sampling))
        if num_threads == "auto":
            num_threads = max(96, (os.cpu_count() or 1) * 16)
        workers = max(1, min(int(num_threads), len(items)))

        bar = tqdm(total=len(items)) if progress_bar else None

        def one(kwargs: dict[str, Any]) -> ProgramState:
            state = self._start(chosen, (), {**self.bind_arguments, **kwargs}, defaults, False)
            if bar is not None:
                bar.update()
            return state

        try:
            if workers == 1:
                return [one(kwargs) for kwargs in items]
            with ThreadPoolExecutor(workers, thread_name_prefix="sprig-batch") as pool:
                return list(pool.map(one, items))
        finally:
            if bar is not None:
                bar.close()

    def _as_kwargs(self, item: dict[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(item, dict):
            return item
        values = list(item)
        if not len(self._required) <= len(values) <= len(self.arg_names):
            raise TypeError(f"{self.__name__} takes {len(self.arg_names)} arguments; got {values!r}")
        return dict(zip(self.arg_names, values, strict=False))


def function(func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None) -> Any:
    """Decorate a program: `@function` or `@function(...)`.

    `num_api_spec_tokens` is accepted for SGLang compatibility and has no effect: every
    gen is its own request on every sprig backend.
    """
    if func is not None:
        return Program(func)
    return Program
