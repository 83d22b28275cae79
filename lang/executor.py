"""The interpreter: one worker thread per program state runs its expressions in order.

`s += expr` only queues `expr`, so a program's Python code runs ahead of its model calls
and the forks of a state make their calls concurrently. Reading a result (`s["x"]`,
`s.text()`, a fork, the end of `run`) waits for the calls it depends on.

Errors: a failed expression stops its worker and drops the queued rest; the error is
raised at the program's next wait, and every later `submit`, with the line of the
program that queued the failed expression spliced into its traceback.

Images: `images_` holds the state's images in the order their tokens stand in the text
(every call sends them all); `cur_images` those of the open role, each with the span of
its token in the text, from which the role's message is built as OpenAI content parts.

Thread safety: `_cond` guards the queue and every field that other threads read while
the worker runs (text, variables, pending names, status); the worker is the only writer
of the text, messages, images and variables until the state is forked or finished.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

from sprig.backend.base import STREAMED_LOGPROB_KEYS, Backend, Prompt
from sprig.chat_template import ChatTemplate
from sprig.cost import Ledger
from sprig.images import ImageData, content_parts, encode_image
from sprig.ir import (
    CommitLazy,
    Constant,
    Expr,
    ExprList,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    VarScopeBegin,
    VarScopeEnd,
    bound_names,
)
from sprig.reasoning import reasoning_name
from sprig.sampling import GenParams, parse_typed

Site = tuple[types.FrameType, int, int]  # (frame, f_lasti, f_lineno) where an expr was queued
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_META = os.path.join(_HERE, "meta") + os.sep


def user_site() -> Site | None:
    """The innermost frame outside sprig's interpreter modules: the program's line."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_HERE) or name.startswith(_META):
            return frame, frame.f_lasti, frame.f_lineno
        frame = frame.f_back
    return None


def _since(meta: dict[str, Any] | None, taken: dict[str, int]) -> dict[str, Any] | None:
    """`meta` with its streamed logprob lists cut to the entries after `taken` (updated)."""
    if meta is None:
        return None
    out = dict(meta)
    for key in STREAMED_LOGPROB_KEYS:
        if key in meta:
            out[key], taken[key] = meta[key][taken[key]:], len(meta[key])
    return out


def _with_site(exc: BaseException, site: Site | None) -> BaseException:
    if site is None:
        return exc
    frame, lasti, lineno = site
    return exc.with_traceback(types.TracebackType(exc.__traceback__, frame, lasti, lineno))


class StreamExecutor:
    """Executes the expressions of one program state; see the module docstring."""

    def __init__(
        self,
        backend: Backend,
        defaults: GenParams,
        *,
        stream: bool = False,
        ledger: Ledger | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.ledger = ledger if ledger is not None else Ledger()
        self.chat_template = chat_template or backend.chat_template
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.images_: list[ImageData] = []
        self.cur_images: list[tuple[int, int, ImageData]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.var_text: dict[str, str] = {}  # raw generated text per name (what streams)
        self.cur_role: str | None = None
        self.cur_role_begin = 0
        self._scopes: dict[str, int] = {}
        self._cond = threading.Condition()
        self._todo: deque[tuple[Expr, Site | None]] = deque()
        self._pending: Counter[str] = Counter()
        self._ended = self._finished = False
        self._error: BaseException | None = None
        self._children: list[StreamExecutor] = []
        threading.Thread(target=self._work, name="sprig-executor", daemon=True).start()

    # ---- the program's side -------------------------------------------------------

    def submit(self, expr: Expr, site: Site | None = None) -> None:
        with self._cond:
            self._check_open()
            self._pending.update(bound_names(expr))
            self._todo.append((expr, site))
            self._cond.notify_all()

    def sync(self) -> None:
        """Wait until every queued expression has run; raise the error if one failed."""
        self._wait(lambda: not self._todo)

    def get_var(self, name: str) -> Any:
        self._wait(lambda: not self._pending[name])
        with self._cond:
            if name not in self.variables:
                raise KeyError(f"no variable {name!r}; bound so far: {sorted(self.variables)}")
            return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        with self._cond:
            self.variables[name] = value
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Record an error raised by the program's own code (streamed runs)."""
        with self._cond:
            self._error = self._error or error
            self._cond.notify_all()

    def end(self) -> None:
        """No more expressions will come; the worker exits once the queue is empty.
        Ends the forks too."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()
            children = list(self._children)
        for child in children:
            child.end()

    def wait_finished(self) -> None:
        """After `end`: wait for this state and its forks to drain; raise the first error."""
        self._wait(lambda: self._finished)
        for child in list(self._children):
            child.wait_finished()

    def iter_text(self, var: str | None = None, *, with_meta: bool = False) -> Iterator[Any]:
        """Pieces of the text (or of variable `var`) as they are appended, then raise the
        program's error if it failed. With `with_meta`, `(piece, meta)` pairs: `var`'s
        meta_info as of that piece (None without `var`), whose output-side logprob lists
        hold the entries since the previous piece only, as SGLang streams them."""
        pos, taken = 0, dict.fromkeys(STREAMED_LOGPROB_KEYS, 0)
        while True:
            with self._cond:
                self._cond.wait_for(lambda seen=pos: len(self._source(var)) > seen or self._drained(var))
                piece = self._source(var)[pos:]
                pos += len(piece)
                meta = self.meta_info.get(var) if with_meta and var is not None else None
                done = self._drained(var)
            if piece:
                yield (piece, _since(meta, taken)) if with_meta else piece
            if done:
                break
        self._raise_error()

    def fork(self, size: int, site: Site | None = None) -> list[StreamExecutor]:
        """`size` child states that continue from this one's text, messages, images and
        variables; for `size > 1` the shared text is committed to the cache first."""
        with self._cond:
            self._check_open()
        if size > 1:
            self.submit(CommitLazy(), site)
        self.sync()
        children = []
        for _ in range(size):
            child = StreamExecutor(
                self.backend, self.defaults, stream=self.stream, ledger=self.ledger,
                chat_template=self.chat_template,
            )
            child.text_, child.messages_ = self.text_, list(self.messages_)
            child.images_, child.cur_images = list(self.images_), list(self.cur_images)
            child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
            child.cur_role, child.cur_role_begin = self.cur_role, self.cur_role_begin
            children.append(child)
        with self._cond:
            self._children.extend(children)
        return children

    def _source(self, var: str | None) -> str:
        return self.text_ if var is None else self.var_text.get(var, "")

    def _drained(self, var: str | None) -> bool:
        if self._finished or self._error is not None:
            return True
        return var is not None and var in self.var_text and not self._pending[var]

    def _wait(self, ready: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: ready() or self._error is not None)
            self._raise_error()

    def _check_open(self) -> None:
        self._raise_error()
        if self._ended:
            raise RuntimeError("this program state has finished; it takes no more expressions")

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- the worker's side --------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._todo or self._ended)
                if not self._todo:
                    self._finished = True
                    self._cond.notify_all()
                    return
                expr, site = self._todo[0]
            try:
                self._execute(expr)
            except Exception as exc:
                with self._cond:
                    self._error = self._error or _with_site(exc, site)
                    self._todo.clear()
                    self._pending.clear()
                    self._finished = True
                    self._cond.notify_all()
                return
            with self._cond:
                self._todo.popleft()
                self._cond.notify_all()

    def _execute(self, expr: Expr) -> None:
        _HANDLERS[type(expr)](self, expr)

    def _append(self, text: str, var: str | None = None, meta: Any = None) -> None:
        """Append `text` (streamed into `var`, whose meta_info so far is `meta`)."""
        with self._cond:
            self.text_ += text
            if var is not None:
                self.var_text[var] = self.var_text.get(var, "") + text
                if meta is not None:
                    self.meta_info[var] = meta
            self._cond.notify_all()

    def _bind(self, name: str | None, value: Any, meta: Any, raw: str) -> None:
        if name is None:
            return
        with self._cond:
            self.variables[name], self.meta_info[name], self.var_text[name] = value, meta, raw
            self._pending[name] -= 1
            self._cond.notify_all()

    def prompt(self) -> Prompt:
        open_text = self.text_[self.cur_role_begin:] if self.cur_role else ""
        messages = tuple(dict(m) for m in self.messages_)
        return Prompt(self.text_, messages, self.cur_role, open_text, tuple(self.images_))

    def _run_list(self, expr: ExprList) -> None:
        for item in expr.items:
            self._execute(item)

    def _run_constant(self, expr: Constant) -> None:
        self._append(expr.value)

    def _run_image(self, expr: Image) -> None:
        token = self.chat_template.image_token
        if token is None:
            raise ValueError(
                f"sgl.image: chat template {self.chat_template.name!r} has no image_token, so the prompt "
                "cannot mark where the image goes; pass the backend a chat_template that has one "
                "(e.g. chat_template='gemma-it')"
            )
        image = encode_image(expr.source)
        self.images_.append(image)
        if self.cur_role is not None:
            self.cur_images.append((len(self.text_), len(self.text_) + len(token), image))
        self._append(token)

    def _run_gen(self, expr: Gen) -> None:
        params = self.defaults.merged(expr.params).with_stop(self.chat_template.stop_str)
        if self.stream and (params.n or 1) == 1:
            with self._cond:
                if expr.name is not None:
                    self.var_text[expr.name], self.meta_info[expr.name] = "", {}
            meta: dict[str, Any] = {}
            raw = ""
            cost = None
            for chunk in self.backend.generate_stream(self.prompt(), params):
                self._append(chunk.text, expr.name, chunk.meta)
                raw, meta, cost = raw + chunk.text, chunk.meta, chunk.cost
            if cost is not None:
                self.ledger.add(cost)
            self._bind(expr.name, parse_typed(raw, params.dtype), meta, raw)
            return
        result = self.backend.generate(self.prompt(), params)
        self.ledger.add(result.cost)
        if isinstance(result.text, str):
            self._append(result.text)
            value: Any = parse_typed(result.text, params.dtype)
            self._bind(expr.name, value, result.meta, result.text)
        else:
            self._append(result.text[0])
            value = [parse_typed(t, params.dtype) for t in result.text]
            self._bind(expr.name, value, list(result.meta), result.text[0])

    def _run_select(self, expr: Select) -> None:
        selection = self.backend.select(self.prompt(), expr.choices, expr.method)
        self.ledger.add(selection.cost)
        self._append(selection.decision)
        self._bind(expr.name, selection.decision, selection.meta, selection.decision)

    def _run_role_begin(self, expr: RoleBegin) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {expr.role!r} begun inside role {self.cur_role!r}; roles do not nest")
        default_system = self.chat_template.default_system_prompt
        if not self.messages_ and expr.role != "system" and default_system:
            self._run_role_begin(RoleBegin("system"))
            self._append(default_system)
            self._run_role_end(RoleEnd("system"))
        prefix, _ = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._append(prefix)
        self.cur_role, self.cur_role_begin = expr.role, len(self.text_)

    def _run_role_end(self, expr: RoleEnd) -> None:
        if self.cur_role != expr.role:
            raise ValueError(f"role {expr.role!r} ended while the open role is {self.cur_role!r}")
        text = self.text_[self.cur_role_begin:].lstrip()
        content: str | list[dict[str, Any]] = text
        if self.cur_images:
            content = content_parts(self.text_, len(self.text_) - len(text), self.cur_images)
        _, suffix = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._append(suffix)
        self.messages_.append({"role": expr.role, "content": content})
        self.cur_role, self.cur_images = None, []

    def _run_scope_begin(self, expr: VarScopeBegin) -> None:
        self._scopes[expr.name] = len(self.text_)

    def _run_scope_end(self, expr: VarScopeEnd) -> None:
        text = self.text_[self._scopes.pop(expr.name):]
        self._bind(expr.name, text, None, text)

    def _run_separate(self, expr: SeparateReasoning) -> None:
        split = expr.format.split
        for name in expr.names:
            with self._cond:
                value, raw = self.variables[name], self.var_text[name]
                texts = value if isinstance(value, list) else [value]
                parts = [split(str(t)) for t in texts]
                answers, reasonings = [a for _, a in parts], [r for r, _ in parts]
                many = isinstance(value, list)
                self.variables[name] = answers if many else answers[0]
                self.variables[reasoning_name(name)] = reasonings if many else reasonings[0]
                at = self.text_.rfind(raw)
                if not self.stream and at >= 0:
                    self.text_ = self.text_[:at] + split(raw)[1] + self.text_[at + len(raw):]
                self._pending[name] -= 1
                self._pending[reasoning_name(name)] -= 1
                self._cond.notify_all()

    def _run_commit(self, expr: CommitLazy) -> None:
        if self.text_:
            self.ledger.add(self.backend.commit(self.prompt()))


_HANDLERS: dict[type, Callable[[StreamExecutor, Any], None]] = {
    ExprList: StreamExecutor._run_list,
    Constant: StreamExecutor._run_constant,
    Image: StreamExecutor._run_image,
    Gen: StreamExecutor._run_gen,
    Select: StreamExecutor._run_select,
    RoleBegin: StreamExecutor._run_role_begin,
    RoleEnd: StreamExecutor._run_role_end,
    VarScopeBegin: StreamExecutor._run_scope_begin,
    VarScopeEnd: StreamExecutor._run_scope_end,
    CommitLazy: StreamExecutor._run_commit,
    SeparateReasoning: StreamExecutor._run_separate,
}
