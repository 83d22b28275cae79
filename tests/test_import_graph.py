"""The package's layering: no import cycles (lazy imports included), and every module
imports on its own, in a fresh interpreter state, whatever was imported before it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def test_the_graph_reader_finds_cycles_and_reach() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_graph.cycles(g) == [["a", "b", "c"]]
    assert import_graph.reach(g, "d") == {"a", "b", "c"}
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def test_lazy_and_relative_imports_are_edges(tmp_path: Path) -> None:
    pkg = tmp_path / "runtime"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from sprig.runtime import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\nfrom . import c\n")
    (pkg / "c.py").write_text("from .a import f\n")
    for other in ("lang", "radix", "kernels"):
        (tmp_path / other).mkdir()
    g = import_graph.graph(tmp_path)
    assert g["sprig.runtime.a"] == {"sprig.runtime.b"} and g["sprig.runtime.b"] == {"sprig.runtime.c"}
    assert import_graph.cycles(g) == [["sprig.runtime.a", "sprig.runtime.b", "sprig.runtime.c"]]


def test_no_import_cycles() -> None:
    assert import_graph.cycles(import_graph.graph()) == []


def test_every_module_imports_alone() -> None:
    names = sorted(import_graph.modules())
    script = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'sprig' or m.startswith('sprig.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {e!r}')\n"
        "print('\\n'.join(failed))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_the_wire_format_imports_nothing_of_sprig() -> None:
    """The codec and its messages stand alone; the request, defined and registered where
    it is validated (`request_contract`, and `sampling.params` which it imports), is
    imported by both processes that carry it."""
    graph = import_graph.graph()
    assert graph["sprig.runtime.wire"] == set()
    for sender_or_receiver in ("sprig.runtime.server.request_manager", "sprig.runtime.server.scheduler_process"):
        assert "sprig.runtime.request_contract" in graph[sender_or_receiver]
