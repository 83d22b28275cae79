"""Programs on the scripted backend: text order, variables, forks, bind, typed gens."""

from __future__ import annotations

import subprocess
import sys

import pytest
from scripted_backend import ScriptedBackend

import sprig as sgl


def test_text_segments_and_gens_keep_program_order() -> None:
    backend = ScriptedBackend(["one", "two"])

    @sgl.function
    def program(s, topic):
        s += "Topic: " + topic + "\n"
        s += "A:" + sgl.gen("a", max_tokens=8, stop="\n") + "\n"
        s += "B:" + sgl.gen("b")

    state = program.run(topic="cats", backend=backend)
    assert state.text() == "Topic: cats\nA:one\nB:two"
    assert (state["a"], state["b"]) == ("one", "two")
    first, second = backend.calls
    assert first.prompt.text == "Topic: cats\nA:"
    assert second.prompt.text == "Topic: cats\nA:one\nB:"
    assert first.params.max_new_tokens == 8 and first.params.stop == ("\n",)
    assert second.params.max_new_tokens == 128  # the run default


def test_run_sampling_defaults_apply_unless_a_gen_overrides() -> None:
    backend = ScriptedBackend(["x", "y"])

    @sgl.function
    def program(s):
        s += sgl.gen("a")
        s += sgl.gen("b", temperature=0.9)

    program.run(backend=backend, temperature=0.0, max_new_tokens=5)
    a, b = (c.params for c in backend.calls)
    assert (a.temperature, a.max_new_tokens) == (0.0, 5)
    assert (b.temperature, b.max_new_tokens) == (0.9, 5)


def test_fork_copies_state_commits_once_and_join_gathers(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def program(s):
        s += "Q:" + sgl.gen("q") + "\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"branch {i}:" + sgl.gen("x")
        seen = [f["x"] for f in forks]
        forks.join()
        s += "done"
        return seen, [f.text() for f in forks], [f["q"] for f in forks]

    state = program.run(backend=echo_backend)
    seen, texts, inherited = state.ret_value
    assert inherited == ["<0>"] * 3
    assert sorted(seen) == ["<1>", "<2>", "<3>"]
    assert texts == [f"Q:<0>\nbranch {i}:{x}" for i, x in enumerate(seen)]
    assert state["x"] == seen
    assert state.text() == "Q:<0>\ndone"
    kinds = echo_backend.kinds()
    assert kinds.count("commit") == 1
    assert kinds.index("commit") == 1  # after the first gen, before every branch
    assert echo_backend.calls[1].prompt.text == "Q:<0>\n"


def test_forks_run_concurrently() -> None:
    backend = ScriptedBackend(lambda text, params: "ok", delay=0.1)

    @sgl.function
    def program(s):
        s += "p"
        forks = s.fork(4)
        forks += sgl.gen("x")
        forks.join()

    state = program.run(backend=backend)
    assert state["x"] == ["ok"] * 4
    assert backend.max_concurrent > 1


def test_fork_group_takes_per_branch_expressions(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def program(s):
        forks = s.fork(2)
        forks += lambda i: f"[{i}]"
        forks += ["a", "b"]
        return [f.text() for f in forks]

    assert program.run(backend=echo_backend).ret_value == ["[0]a", "[1]b"]
    assert "commit" not in echo_backend.kinds()  # nothing to commit: empty text


def test_a_finished_state_takes_no_more_expressions(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def program(s):
        s += "x"

    state = program.run(backend=echo_backend)
    with pytest.raises(RuntimeError, match="finished"):
        state += "more"
    with pytest.raises(RuntimeError, match="finished"):
        state.fork(1)


def test_importing_sprig_does_not_import_the_runtime() -> None:
    code = "import sys, sprig, sprig.meta; assert 'sprig.runtime' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bind_fixes_arguments_and_rejects_unknown_names(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def program(s, greeting, name):
        s += f"{greeting}, {name}"

    hello = program.bind(greeting="Hello")
    assert hello.run(name="Ada", backend=echo_backend).text() == "Hello, Ada"
    assert hello.bind(name="Bob").run(backend=echo_backend).text() == "Hello, Bob"
    with pytest.raises(TypeError, match="no parameters"):
        program.bind(nope=1)


def test_default_backend_and_runtime_like_endpoint_attribute(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def program(s):
        s += sgl.gen("x")

    with pytest.raises(ValueError, match="no backend"):
        program.run()

    class Launcher:
        endpoint = echo_backend

    sgl.set_default_backend(Launcher())
    assert program()["x"] == "<0>"


@pytest.mark.parametrize(
    ("make", "reply", "regex", "stop", "value"),
    [
        (lambda: sgl.gen_int("v"), "42", sgl.REGEX_INT, (" ", "\n"), 42),
        (lambda: sgl.gen("v", dtype=int), "-7 ", sgl.REGEX_INT, (" ", "\n"), -7),
        (lambda: sgl.gen("v", dtype=float), "2.5", sgl.REGEX_FLOAT, (" ", "\n"), 2.5),
        (lambda: sgl.gen("v", dtype=bool), "False", sgl.REGEX_BOOL, None, False),
        (lambda: sgl.gen_string("v"), '"hi there"', sgl.REGEX_STR, None, '"hi there"'),
        (lambda: sgl.gen("v", dtype="str"), '"x"', sgl.REGEX_STR, None, '"x"'),
        (lambda: sgl.gen("v", dtype=str, stop="\n"), '"cut by', sgl.REGEX_STR, ("\n",), '"cut by'),
    ],
)
def test_dtype_gens_send_the_regex_and_bind_the_python_type(make, reply, regex, stop, value) -> None:
    backend = ScriptedBackend([reply])

    @sgl.function
    def program(s):
        s += "v=" + make()

    state = program.run(backend=backend)
    native = backend.calls[0].params.to_native()
    assert native["regex"] == regex
    assert "dtype" not in native
    assert native.get("stop") == (list(stop) if stop else None)
    assert state["v"] == value and type(state["v"]) is type(value)
    assert state.text() == "v=" + reply


def test_dtype_and_regex_together_is_an_error() -> None:
    with pytest.raises(ValueError, match="dtype or regex"):
        sgl.gen("v", dtype=int, regex="[0-9]+")


@pytest.mark.parametrize("seed", ["1", 1.5, True])
def test_a_seed_that_is_not_an_int_is_an_error(seed) -> None:
    with pytest.raises(ValueError, match="seed must be an int"):
        sgl.gen("v", seed=seed)


def test_n_samples_bind_a_list_and_append_the_first(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def program(s):
        s += sgl.gen("x", n=3)

    state = program.run(backend=echo_backend)
    assert state["x"] == ["<0>", "<1>", "<2>"]
    assert state.text() == "<0>"
    assert len(state.get_meta_info("x")) == 3


def test_var_scope_and_meta_info(echo_backend: ScriptedBackend) -> None:
    @sgl.function
    def program(s):
        with s.var_scope("span"):
            s += "a" + sgl.gen("g", return_logprob=True) + "b"

    state = program.run(backend=echo_backend)
    assert state["span"] == "a<0>b"
    meta = state.get_meta_info("g")
    assert meta["completion_tokens"] == 3
    assert [e[2] for e in meta["output_token_logprobs"]] == list("<0>")
