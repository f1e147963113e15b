"""`scripts/train.py` loaded as a module, for the tests and the worker scripts that call its functions."""

import importlib.util
from pathlib import Path


def load_train_script():
    """A fresh module of `scripts/train.py` (which is a script, not part of the package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "train.py"
    spec = importlib.util.spec_from_file_location("mm_fusion_train_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
