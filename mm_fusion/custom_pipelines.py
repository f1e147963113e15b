"""
The pipelines a saved model carries, so that `pipeline(task, model=dir, trust_remote_code=True)` serves it where
mm_fusion is not installed: the config's `custom_pipelines` entries and the pipelines' code.

- Saving ([`save_custom_pipelines`], called by `MMFusionConfig.save_pretrained`, which `save_pretrained` of every
  model calls after recording its head in `config.architectures`): the custom pipelines registered in this process
  (`PIPELINE_REGISTRY.register_pipeline`; mm_fusion registers its own at import) whose Auto class loads that head, as
  transformers' own `Pipeline.save_pretrained` records a registered pipeline.
- Loading ([`served_here`], read by `MMFusionConfig.custom_pipelines`): transformers prefers a saved entry over its
  registry and then insists on `trust_remote_code`, so a task this process has registered with the same class is
  left out of what `pipeline()` reads, and the installed class serves it. The file keeps every entry.

Saved with a model's code (its configuration file imports it); it never imports pipeline code itself.
"""

import sys

from transformers.dynamic_module_utils import custom_object_save


def _registry():
    """transformers' pipeline registry, or `None` where `transformers.pipelines` was never imported (then nothing
    was registered with it, and importing it only to find that out would cost seconds)."""
    if "transformers.pipelines" not in sys.modules:
        return None
    from transformers.pipelines import PIPELINE_REGISTRY

    return PIPELINE_REGISTRY


def _entry_name(cls: type) -> str:
    """`module.Class` as a saved directory names a class of its code."""
    return f"{cls.__module__.split('.')[-1]}.{cls.__name__}"


def registered_pipelines(config) -> dict[str, tuple[type, str]]:
    """The custom pipelines registered in this process that serve the head `config` was saved with: task -> (pipeline
    class, name of the Auto class that loads the model)."""
    registry = _registry()
    heads = set(getattr(config, "architectures", None) or ())
    if registry is None or not heads:
        return {}
    found = {}
    for task, info in registry.supported_tasks.items():
        impl = info.get("impl")
        if task not in (getattr(impl, "_registered_impl", None) or {}):  # transformers' own pipelines
            continue
        for loader in info.get("pt", ()):
            # mm_fusion registers loaders that check the saved head first and name the Auto class they load with
            # (head_check.py).
            auto_class = getattr(loader, "auto_class", loader)
            try:
                model_class = auto_class._model_mapping[type(config)]
            except (KeyError, AttributeError):
                continue
            if model_class.__name__ in heads:
                found[task] = (impl, auto_class.__name__)
                break
    return found


def save_custom_pipelines(config, save_directory) -> dict[str, dict]:
    """Copy the code of the pipelines that serve `config`'s head into `save_directory`; returns the
    `custom_pipelines` entries that name them."""
    entries = {}
    for task, (impl, auto_class) in registered_pipelines(config).items():
        custom_object_save(impl, save_directory)
        entries[task] = {"impl": _entry_name(impl), "pt": [auto_class], "type": "multimodal"}
    return entries


def served_here(task: str, entry: dict) -> bool:
    """Whether this process's pipeline registry serves `task` with the class a saved `custom_pipelines` entry names."""
    registry = _registry()
    registered = registry.supported_tasks.get(task) if registry is not None else None
    if registered is None or not isinstance(registered.get("impl"), type):
        return False
    return _entry_name(registered["impl"]) == entry.get("impl")


__all__ = ["registered_pipelines", "save_custom_pipelines", "served_here"]
