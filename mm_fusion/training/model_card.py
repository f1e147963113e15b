"""The model card of a training run: a Jinja template filled with the run's model, data, metrics and curves."""

import json
import platform
from pathlib import Path
from typing import Any


CURVES_FILE = "training_curves.png"


def plot_training_curves(log_history: list[dict[str, Any]], path: str | Path, metric: str | None = None) -> bool:
    """
    Plot training loss (and evaluation loss) against steps, and the evaluation `metric` against steps, from
    `trainer.state.log_history`, into a PNG at `path`. Returns False (and writes nothing) when nothing was logged.
    """
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [h for h in log_history if "eval_loss" in h and "step" in h]
    if not train and not evals:
        return False
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    key = f"eval_{metric}" if metric else None
    with_metric = key is not None and any(key in h for h in evals)
    fig, axes = plt.subplots(1, 2 if with_metric else 1, figsize=(11 if with_metric else 6, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot([h["step"] for h in evals], [h["eval_loss"] for h in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    if with_metric:
        ax = axes[0][1]
        points = [(h["step"], h[key]) for h in evals if key in h]
        ax.plot(*zip(*points), "o-", color="tab:green")
        ax.set_xlabel("step")
        ax.set_ylabel(f"eval {metric}")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def framework_versions() -> dict[str, str]:
    """Versions of the libraries a run used, for the card."""
    import accelerate
    import datasets
    import tokenizers
    import torch
    import transformers

    import mm_fusion

    return {
        "mm_fusion": mm_fusion.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
    }


def write_model_card(template_path: str | Path, output_dir: str | Path, context: dict[str, Any]) -> Path:
    """
    Render the Jinja template at `template_path` with `context` into `output_dir/README.md`, after plotting
    `context["log_history"]` into `output_dir/training_curves.png` (the card links it when it exists).
    """
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    context = dict(context)
    context["curves"] = (
        CURVES_FILE
        if plot_training_curves(context.get("log_history", []), output_dir / CURVES_FILE, context.get("main_metric"))
        else None
    )
    context.setdefault("versions", framework_versions())
    template_path = Path(template_path)
    environment = Environment(
        loader=FileSystemLoader(template_path.parent), undefined=StrictUndefined, keep_trailing_newline=True
    )
    environment.filters["tojson"] = json.dumps
    card = environment.get_template(template_path.name).render(**context)
    path = output_dir / "README.md"
    path.write_text(card)
    return path
