"""Import a tool from ``scripts/`` (not part of the installed package) under a private name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    module_name = f"kvtransfer_script_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, SCRIPTS_DIR / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no script {name!r} in {SCRIPTS_DIR}")
    module = importlib.util.module_from_spec(spec)
    # Registered before running so dataclasses defined in the script can find their module.
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
