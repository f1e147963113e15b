"""`evaluate` metric modules that ship with mm_fusion and load from their local path, so no hub access is needed."""

from pathlib import Path


METRICS_DIR = Path(__file__).parent


def load_metric(name: str, **kwargs):
    """`evaluate.load` of one of the shipped modules: `"accuracy"` or `"retrieval"`."""
    import evaluate

    path = METRICS_DIR / f"{name}.py"
    if not path.is_file():
        available = sorted(p.stem for p in METRICS_DIR.glob("*.py") if p.stem != "__init__")
        raise ValueError(f"No shipped metric {name!r}; available: {available}.")
    return evaluate.load(str(path), **kwargs)
