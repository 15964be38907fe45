"""Models shipped inside the package.

``demo-llama`` is the demo's default model: a tiny Llama trained by
``scripts/train_demo_model.py`` on this project's own documentation, in Hugging Face's layout, so
it loads through the same code as any checkpoint directory (its README.md says what and how).
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL = "demo"


def demo_model_dir() -> Path:
    """The directory of the shipped demo model (package data)."""
    return Path(__file__).resolve().parent / "demo-llama"


def resolve_model(model: str) -> str:
    """``"demo"`` as the demo model's directory; any other name (``builtin[:preset]``, a
    directory) unchanged."""
    return str(demo_model_dir()) if model == DEMO_MODEL else model
