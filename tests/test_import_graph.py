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


def _import_each_alone(names: list[str]) -> subprocess.Popen:
    """A fresh interpreter importing each of `names` with no sprig module loaded before it;
    it prints the ones that fail."""
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
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


def test_every_module_imports_alone() -> None:
    names = sorted(import_graph.modules())
    runs = [_import_each_alone(names[i::2]) for i in range(2)]  # two interpreters, one a core
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        assert out.strip() == ""
