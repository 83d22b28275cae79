"""sprig's demo model: a small trained Llama that solves arithmetic word problems.

It ships inside the package (trained by `scripts/train_demo_model.py`), so the examples
and the main job have a model that knows something without reaching a model hub.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_PATH = Path(__file__).parent / "model"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def ensure_demo_model() -> Path:
    """The demo checkpoint's directory; raises FileNotFoundError naming what is missing."""
    missing = [name for name in _REQUIRED if not (DEMO_MODEL_PATH / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"demo model incomplete at {DEMO_MODEL_PATH} (missing {', '.join(missing)}); "
            "rebuild it with `python scripts/train_demo_model.py`"
        )
    return DEMO_MODEL_PATH
