"""
Named model presets, as open_clip's `model_configs/`: `scripts/train.py --model_config NAME|FILE`. A preset is a JSON
(or YAML) file with up to three parts:

- `model`: values of `ModelArguments`' options (`hidden_size`, `fusion_layers`...), the defaults of this run; flags
  and a config file's keys win. `default.json` holds every one of them: `ModelArguments`' own defaults are read from
  it, so the two cannot differ.
- `config`: MMFusionConfig settings for the model built from scratch, as `--config_overrides` gives them (those win).
- `conv_tower_config`: MMFusionConfig settings for a ResNet / ConvNeXt tower built from scratch whose stages the
  cross-attention fusion reads, with a classification head ([`conv_tower_settings`]); other runs do not take them,
  and the log says so.

`default` is the default run's model; a benchmark's own baseline models live with that benchmark
(`scripts/benchmarks/model_configs/`), given by path.
"""

import json
import logging
from pathlib import Path


PRESETS_DIR = Path(__file__).with_name("model_configs")
DEFAULT_PRESET = "default"
PARTS = ("description", "model", "config", "conv_tower_config")

logger = logging.getLogger(__name__)


def preset_names() -> list[str]:
    """The shipped presets, by name."""
    return sorted(path.stem for path in PRESETS_DIR.glob("*.json"))


def load_model_preset(name_or_file: str) -> dict:
    """A shipped preset by name, or a JSON / YAML file of the same form; a one-line `ValueError` for anything else."""
    path = Path(name_or_file)
    if not path.suffix and (PRESETS_DIR / f"{name_or_file}.json").is_file():
        path = PRESETS_DIR / f"{name_or_file}.json"
    elif not path.is_file():
        raise ValueError(
            f"--model_config {name_or_file!r} is neither a shipped preset ({', '.join(preset_names())}) nor a file."
        )
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            preset = yaml.safe_load(path.read_text())
        else:
            preset = json.loads(path.read_text())
    except Exception as err:
        raise ValueError(f"--model_config {path}: not a JSON / YAML file ({' '.join(str(err).split())}).") from None
    if not isinstance(preset, dict) or set(preset) - set(PARTS):
        extra = sorted(set(preset) - set(PARTS)) if isinstance(preset, dict) else type(preset).__name__
        raise ValueError(f"--model_config {path}: a preset holds {', '.join(PARTS)}; got {extra}.")
    for part in PARTS[1:]:
        if not isinstance(preset.get(part, {}), dict):
            raise ValueError(f"--model_config {path}: {part!r} must be a mapping of setting: value.")
    return {"name": name_or_file, "path": str(path), **preset}


def conv_tower_settings(preset: dict, model_args, overrides: dict) -> dict:
    """
    The preset's `conv_tower_config` that a run's config takes, unless `--config_overrides` names them: for a
    ResNet / ConvNeXt tower built from scratch (no pretrained tower) with cross-attention fusion (`hierarchical` or
    `cross_attention`) and a classification head. Not for `--task pretrain` (its contrastive head needs image
    features without a text), nor `vision_text_attention` with `vision_film` (which conditions the tower instead),
    nor `init_scheme` where the overrides name a setting it replaced (`fusion_init`, `vision_film_init`).
    """
    settings = dict(preset.get("conv_tower_config", {}))
    if not settings:
        return {}
    if (
        model_args.task == "pretrain"
        or model_args.vision_tower not in ("resnet", "convnext")
        or model_args.fusion_type not in ("hierarchical", "cross_attention")
        or model_args.vision_model_name_or_path
        or model_args.text_model_name_or_path
    ):
        logger.info(
            "Model preset %s: its conv_tower_config %s is for a ResNet / ConvNeXt tower built from scratch with "
            "cross-attention fusion and a classification head, which this run is not; not taken.",
            preset["name"], settings,
        )  # fmt: skip
        return {}
    if overrides.get("vision_film"):
        settings.pop("vision_text_attention", None)
    if {"fusion_init", "vision_film_init"} & overrides.keys():  # the settings init_scheme replaced name it too
        settings.pop("init_scheme", None)
    return {key: value for key, value in settings.items() if key not in overrides}


__all__ = ["DEFAULT_PRESET", "PRESETS_DIR", "conv_tower_settings", "load_model_preset", "preset_names"]
