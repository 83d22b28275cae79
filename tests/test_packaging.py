"""The wheel must contain every subpackage: pyproject lists them by hand (package-dir mapping)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = config["package-dir"]
    found = set()
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == set(config["packages"])


@pytest.mark.parametrize("folder", ["model", "draft"])
def test_the_demo_checkpoints_are_package_data(folder: str) -> None:
    """The demo model and its draft model ship in the wheel: every file of each matches a
    package-data pattern of sprig.runtime.demo."""
    import fnmatch

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config["package-data"]["sprig.runtime.demo"]
    demo = ROOT / config["package-dir"]["sprig.runtime"] / "demo"
    files = [f.relative_to(demo).as_posix() for f in (demo / folder).iterdir()]
    assert "config.json" in [Path(f).name for f in files] and "model.safetensors" in [Path(f).name for f in files]
    assert all(any(fnmatch.fnmatch(f, p) for p in patterns) for f in files)
