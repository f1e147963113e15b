"""
A saved model asked for a task whose head it was not saved with is refused before any weight is read.

transformers loads any checkpoint into any head and initialises what is missing: right for fine-tuning (a pretraining
checkpoint starts a VQA model, `scripts/train.py --model_name_or_path`), wrong for inference, where a VQA model served
by the zero-shot pipeline gives near-uniform scores from fresh layers, silently. Two hooks, both before
`from_pretrained` reads a weight:

- [`pipeline_loader`]: what mm_fusion registers as the model class of each of its pipeline tasks. `pipeline()` calls
  its `from_pretrained` with the task, and it checks the saved head before the Auto class loads the model; loading
  through the Auto classes themselves, as fine-tuning does, is left alone.
- [`ZeroShotLoader`]: what `AutoModelForZeroShotImageClassification` maps an MMFusion config to. transformers' own
  zero-shot pipeline loads through that Auto class, which has no fine-tuning use: a checkpoint saved with another
  MMFusion head is always refused there.

A model saved by this code with a class mm_fusion does not know (a user's subclass) is left alone.
"""

import os

import transformers
from transformers import AutoConfig, PretrainedConfig

from .configuration_mm_fusion import MMFusionConfig
from .modeling_mm_fusion import MMFusionForPretraining


# What each saved MMFusion class holds beyond the towers and fusion, and the pipeline tasks that serve it.
SAVED_HEADS = {
    "MMFusionModel": ("no head: the towers and fusion only", ()),
    "MMFusionForImageTextClassification": ("a classifier over its training answers", ("image-text-classification",)),
    "MMFusionForPretraining": (
        "image and text embeddings (ITC) and a matching head (ITM)",
        (
            "image-text-retrieval",
            "image-text-matching",
            "zero-shot-image-classification",
            "cached-zero-shot-image-classification",
        ),
    ),
}
# Hub options of `from_pretrained` that reading the config alone needs too.
HUB_OPTIONS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "revision",
    "subfolder",
    "token",
    "trust_remote_code",
)


class MissingHeadError(Exception):
    """
    A saved model was asked for a task whose head it was not saved with.

    Not a `ValueError`: `pipeline()` catches `ValueError`, `OSError`, `TypeError` and `RuntimeError` from a model's
    `from_pretrained`, retries, and re-raises them all inside one long traceback where this message would be buried.
    """


def check_saved_head(heads: tuple[str, ...], config, task: str, source) -> None:
    """Raise [`MissingHeadError`] when `config`, a saved model's, has none of `heads` (the class names that serve
    `task`), naming the task, what was saved and what serves it instead."""
    saved = list(getattr(config, "architectures", None) or ())
    if not saved or set(saved) & set(heads) or not set(saved) <= SAVED_HEADS.keys():
        return
    wanted = " or ".join(f"{head} ({SAVED_HEADS[head][0]})" for head in heads)
    has = ", ".join(f"{name} ({SAVED_HEADS[name][0]})" for name in saved)
    serves = sorted({other for name in saved for other in SAVED_HEADS[name][1]})
    instead = f" It serves {', '.join(serves)}." if serves else ""
    if "MMFusionForImageTextClassification" in heads and "MMFusionForPretraining" in saved:
        instead += (
            " To answer questions with it, fine-tune it first on labelled pairs: scripts/train.py --task vqa "
            f"--model_name_or_path {source}."
        )
    raise MissingHeadError(
        f"{task} needs a model saved with {wanted}, but {source} was saved as {has}. Loaded anyway, that head would "
        f"start from random weights and its outputs would mean nothing, so nothing was loaded.{instead}"
    )


def pipeline_loader(auto_class_name: str, heads: tuple[str, ...]) -> type:
    """
    The model class `pipeline()` is given for an mm_fusion task (the registry's `pt_model`): its `from_pretrained`
    reads the saved config, refuses a model without one of `heads` ([`check_saved_head`]), then loads the model
    through `auto_class_name`. `pipeline()` names the task in `_from_pipeline`.
    """
    auto_class = getattr(transformers, auto_class_name)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        config = kwargs.get("config")
        if not isinstance(config, PretrainedConfig) and isinstance(pretrained_model_name_or_path, (str, os.PathLike)):
            options = {key: kwargs[key] for key in HUB_OPTIONS if key in kwargs}
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **options)
        task = kwargs.get("_from_pipeline") or f"{auto_class_name} for {' / '.join(heads)}"
        check_saved_head(heads, config, f"The {task} pipeline", pretrained_model_name_or_path)
        return auto_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    name = f"{auto_class_name}CheckingHead"
    return type(name, (), {"auto_class": auto_class, "from_pretrained": from_pretrained, "__module__": __name__})


class ZeroShotLoader:
    """
    What `AutoModelForZeroShotImageClassification` maps an MMFusion config to: `from_pretrained` refuses a checkpoint
    saved with another MMFusion head ([`check_saved_head`]); it and `from_config` give an `MMFusionForPretraining`.
    """

    config_class = MMFusionConfig
    head_class = MMFusionForPretraining

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        task = "AutoModelForZeroShotImageClassification (what the zero-shot-image-classification pipeline loads with)"
        check_saved_head((cls.head_class.__name__,), config, task, pretrained_model_name_or_path)
        return cls.head_class.from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        return cls.head_class._from_config(config, **kwargs)


# Registered under the name of the class it gives: transformers' pipelines log an error for a model whose class name is
# not among those registered for their task (`Pipeline.check_model_type`).
ZeroShotLoader.__name__ = MMFusionForPretraining.__name__


__all__ = ["MissingHeadError", "ZeroShotLoader", "check_saved_head", "pipeline_loader"]
