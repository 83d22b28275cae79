"""`Runtime`: the command it builds, a healthy start, and the failure paths."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import sprig as sgl
from sprig.backend.runtime import server_command

FAKE_SERVER = str(Path(__file__).with_name("fake_sprig_server.py"))


def test_server_command_maps_keyword_arguments_to_flags() -> None:
    argv = server_command("/m/tiny", "127.0.0.1", 31234, mem_fraction=0.5, disable_radix_cache=True,
                          enable_x=False, chunked_prefill_size=None, stop_ids=[1, 2])
    assert argv == [sys.executable, "-m", "sprig.runtime", "serve", "--model", "/m/tiny",
                    "--host", "127.0.0.1", "--port", "31234", "--mem-fraction", "0.5",
                    "--disable-radix-cache", "--stop-ids", "1", "2"]


def test_a_runtime_waits_for_health_and_serves_programs() -> None:
    with sgl.Runtime("/m/tiny", launcher=(sys.executable, FAKE_SERVER), launch_timeout=30) as runtime:
        assert runtime.url.startswith("http://127.0.0.1:")
        assert runtime.command[2:6] == ["serve", "--model", "/m/tiny", "--host"]
        assert runtime.endpoint.get_model_name() == "/m/tiny"

        @sgl.function
        def program(s):
            s += "abc" + sgl.gen("n")

        sgl.set_default_backend(runtime)
        assert program.run()["n"] == "[3]"
        process = runtime._process
    assert process is not None and process.poll() is not None  # shut down by the with block


def test_a_server_that_dies_is_reported_with_its_output() -> None:
    crash = "import sys; print('loading weights'); sys.stderr.write('CUDA out of memory\\n'); sys.exit(3)"
    with pytest.raises(RuntimeError, match="exited with code 3") as info:
        sgl.Runtime("/m/tiny", launcher=(sys.executable, "-c", crash), launch_timeout=30)
    assert "CUDA out of memory" in str(info.value) and "loading weights" in str(info.value)


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped() -> None:
    hang = "import time; print('still loading', flush=True); time.sleep(60)"
    with pytest.raises(TimeoutError, match="not healthy within 1s") as info:
        sgl.Runtime("/m/tiny", launcher=(sys.executable, "-c", hang), launch_timeout=1)
    assert "still loading" in str(info.value)


def test_the_default_model_is_the_embedded_demo_model() -> None:
    from sprig.runtime.demo import DEMO_MODEL_PATH

    show_argv_and_fail = "import sys; print(sys.argv, flush=True); sys.exit(3)"
    with pytest.raises(RuntimeError) as info:
        sgl.Runtime(launcher=(sys.executable, "-c", show_argv_and_fail), launch_timeout=5)
    assert f"'--model', '{DEMO_MODEL_PATH}'" in str(info.value)
