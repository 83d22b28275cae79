"""Streaming, batches and errors: how programs execute."""

from __future__ import annotations

import threading
import traceback

import pytest
from scripted_backend import ScriptedBackend

import sprig as sgl


class Reader:
    """Consumes `text_iter` while the backend waits, after each streamed chunk, until
    the reader has received the text up to it: every chunk end is a piece boundary."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.received = 0
        self._cond = threading.Condition()

    def wait_for(self, length: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.received >= length, timeout=5)

    def read(self, iterator) -> list[str]:
        for piece in iterator:
            with self._cond:
                self.pieces.append(piece)
                self.received += len(piece)
                self._cond.notify_all()
        return self.pieces

    def boundaries(self) -> set[int]:
        ends, total = set(), 0
        for piece in self.pieces:
            total += len(piece)
            ends.add(total)
        return ends


def test_text_iter_streams_the_pieces_in_order() -> None:
    reader = Reader()
    backend = ScriptedBackend(["Hello world", "!!"], chunk=4, after_chunk=reader.wait_for)

    @sgl.function
    def program(s):
        s += "A: " + sgl.gen("a") + " B: " + sgl.gen("b")

    state = program.run(backend=backend, stream=True)
    assert "".join(reader.read(state.text_iter())) == "A: Hello world B: !!"
    assert {7, 11, 14, 20} <= reader.boundaries()  # "A: Hell|o wo|rld| B: !!|"
    assert state["a"] == "Hello world"
    assert [c.kind for c in backend.calls] == ["stream", "stream"]


def test_text_iter_of_one_variable() -> None:
    reader = Reader()
    backend = ScriptedBackend(["abcdefg"], chunk=2, after_chunk=reader.wait_for)

    @sgl.function
    def program(s):
        s += "x" + sgl.gen("v") + "y"

    state = program.run(backend=backend, stream=True)
    # the backend waits on text lengths, and the variable's text is the text after "x"
    reader.received = 1
    assert reader.read(state.text_iter("v")) == ["ab", "cd", "ef", "g"]
    assert state.text() == "xabcdefgy"


def test_text_iter_without_stream_yields_the_result_once(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def program(s):
        s += "t" + sgl.gen("v")

    state = program.run(backend=echo_backend)
    assert list(state.text_iter()) == ["t<0>"]
    assert list(state.text_iter("v")) == ["<0>"]


def test_run_batch_returns_states_in_input_order_and_runs_concurrently() -> None:
    backend = ScriptedBackend(lambda text, params: text.upper(), delay=0.05)

    @sgl.function
    def program(s, word):
        s += word + "->" + sgl.gen("up")

    words = [f"w{i}" for i in range(16)]
    states = program.run_batch(
        [{"word": w} for w in words], backend=backend, num_threads=8, progress_bar=True
    )
    assert [s["up"] for s in states] == [f"{w}->".upper() for w in words]
    assert backend.max_concurrent > 1  # calls overlapped: the batch ran on several threads


def test_run_batch_takes_positional_items_and_sampling_defaults(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def program(s, a, b="!"):
        s += a + b + sgl.gen("x")

    states = program.run_batch([("1",), ("2", "?")], backend=echo_backend, temperature=0, num_threads=1)
    assert [s.text()[:2] for s in states] == ["1!", "2?"]
    assert all(c.params.temperature == 0 for c in echo_backend.calls)
    with pytest.raises(TypeError):
        program.run_batch([()], backend=echo_backend)


def _frames(exc: BaseException) -> list[str]:
    return [f.name for f in traceback.extract_tb(exc.__traceback__)]


def test_an_error_in_program_code_surfaces_with_the_program_frame(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def faulty_program(s):
        s += sgl.gen("x")
        raise KeyError("from the program")

    with pytest.raises(KeyError, match="from the program") as info:
        faulty_program.run(backend=echo_backend)
    assert "faulty_program" in _frames(info.value)


def test_a_failed_model_call_surfaces_with_the_line_that_queued_it() -> None:
    def replies(text, params):
        raise ConnectionError("server down")

    @sgl.function
    def calls_the_model(s):
        s += "hi" + sgl.gen("x")

    with pytest.raises(ConnectionError, match="server down") as info:
        calls_the_model.run(backend=ScriptedBackend(replies))
    frames = traceback.extract_tb(info.value.__traceback__)
    names = [f.name for f in frames]
    assert "calls_the_model" in names
    assert names.index("calls_the_model") < names.index("replies")  # spliced before the cause
    site = frames[names.index("calls_the_model")]
    assert site.line == 's += "hi" + sgl.gen("x")'


def test_reading_a_variable_after_a_failure_raises_the_failure() -> None:
    backend = ScriptedBackend(["1", "oops"])

    @sgl.function
    def program(s):
        s += sgl.gen_int("a") + " " + sgl.gen_int("b")
        return s["b"]

    with pytest.raises(ValueError, match="not a int"):
        program.run(backend=backend)


def test_a_streamed_program_error_surfaces_from_text_iter(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def streamed_program(s):
        s += "a"
        raise RuntimeError("mid-stream")

    state = streamed_program.run(backend=echo_backend, stream=True)
    with pytest.raises(RuntimeError, match="mid-stream") as info:
        list(state.text_iter())
    assert "streamed_program" in _frames(info.value)


def test_run_batch_raises_a_failed_program_error() -> None:
    backend = ScriptedBackend(lambda text, params: "ok")

    @sgl.function
    def program(s, i):
        if i == 2:
            raise ValueError(f"bad item {i}")
        s += sgl.gen("x")

    with pytest.raises(ValueError, match="bad item 2"):
        program.run_batch([{"i": i} for i in range(4)], backend=backend)
