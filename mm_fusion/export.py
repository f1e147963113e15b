"""
ONNX export of a saved model: `python -m mm_fusion.export MODEL_DIR OUT_DIR` (or the console script
`mm-fusion-export MODEL_DIR OUT_DIR`).

Each head is written as the graphs its pipelines run, with a dynamic batch and a dynamic text length (the image size
is the one the model was trained at, which its processor resizes to):

- `MMFusionForImageTextClassification` (VQA / classification): `model.onnx`, (`input_ids`, `attention_mask`,
  `pixel_values`) -> `logits`.
- `MMFusionForPretraining`: `image_encoder.onnx`, `pixel_values` -> `image_embeds` (what `get_image_features` gives);
  `text_encoder.onnx`, (`input_ids`, `attention_mask`) -> `text_embeds` (`get_text_features`); and, unless the model
  was trained without its matching head (`itm_loss_weight=0`), `matching.onnx`, (`input_ids`, `attention_mask`,
  `pixel_values`) -> `itm_logits` for text i with image i.

`pixel_values` are what the processor gives, uint8 in [0, 255]: the graph normalises them with the model's own
`image_mean` / `image_std`, as the PyTorch model does. The processor's files and the model's config are saved beside
the graphs, so that the directory holds everything its inference needs, and `onnx_export.json` lists the graphs,
their inputs and outputs, and how far each was from PyTorch on the inputs it was checked on. An export whose graph
differs from PyTorch by more than `--atol` is an error.

The graphs come from `torch.onnx.export`'s `torch.export`-based exporter (it needs `onnxscript`); they are checked
with `onnxruntime`. Install both with `pip install -e ".[onnx]"`.
"""

import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .cli import ScriptArgumentParser, command_name


MANIFEST_NAME = "onnx_export.json"
DEFAULT_ATOL = 1e-4
# The example batch the graph is traced with: 2 pairs (not 1: torch.export fixes a dimension of size 1) of 5 tokens.
EXAMPLE_BATCH, EXAMPLE_LENGTH = 2, 5
# Copied beside the graphs with the remote code (`*.py`); the processor saves its own files.
COPIED = ("config.json", "README.md")


@dataclass(frozen=True)
class Graph:
    """One exported graph: its file, what it reads and what it gives."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def file(self) -> str:
        return f"{self.name}.onnx"


CLASSIFICATION_GRAPHS = (Graph("model", ("input_ids", "attention_mask", "pixel_values"), ("logits",)),)
PRETRAINING_GRAPHS = (
    Graph("image_encoder", ("pixel_values",), ("image_embeds",)),
    Graph("text_encoder", ("input_ids", "attention_mask"), ("text_embeds",)),
    Graph("matching", ("input_ids", "attention_mask", "pixel_values"), ("itm_logits",)),
)


def graphs_for(model) -> tuple[Graph, ...]:
    """The graphs a model's head is exported as."""
    head = type(model).__name__
    if head == "MMFusionForImageTextClassification":
        return CLASSIFICATION_GRAPHS
    if head == "MMFusionForPretraining":
        if model.config.itm_loss_weight == 0:  # its matching head is untrained; the pipelines refuse it too
            return PRETRAINING_GRAPHS[:2]
        return PRETRAINING_GRAPHS
    raise ValueError(
        f"ONNX export covers the heads MMFusionForImageTextClassification and MMFusionForPretraining; the model is "
        f"a {head}."
    )


class _Classify(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, pixel_values):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values).logits


class _ImageEncoder(_Classify):
    def forward(self, pixel_values):
        return self.model.base_model.get_image_features(pixel_values=pixel_values).pooler_output


class _TextEncoder(_Classify):
    def forward(self, input_ids, attention_mask):
        return self.model.base_model.get_text_features(
            input_ids=input_ids, attention_mask=attention_mask
        ).pooler_output


class _Matching(_Classify):
    def forward(self, input_ids, attention_mask, pixel_values):
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values, return_loss=False
        )
        return outputs.itm_logits


# The part of the model each graph runs, as a module of tensors in the graph's input order (what the exporter traces).
GRAPH_MODULES = {
    "model": _Classify,
    "image_encoder": _ImageEncoder,
    "text_encoder": _TextEncoder,
    "matching": _Matching,
}


def example_inputs(model, image_size: int, batch: int = EXAMPLE_BATCH, length: int = EXAMPLE_LENGTH, seed: int = 0):
    """Inputs as the processor gives them: uint8 images of the trained size and right-padded token ids."""
    g = torch.Generator().manual_seed(seed)
    channels = len(model.config.image_mean)
    vocab = model.config.text_config.vocab_size
    input_ids = torch.randint(1, vocab, (batch, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[0] = length
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "pixel_values": torch.randint(0, 256, (batch, channels, image_size, image_size), generator=g).to(torch.uint8),
    }


def _dynamic_shapes(graph: Graph) -> dict[str, dict[int, torch.export.Dim]]:
    batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence")
    shapes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}, "pixel_values": {0: batch}}
    return {name: shapes[name] for name in graph.inputs}


def export_graph(model, graph: Graph, path: Path, inputs: dict, opset: int | None = None) -> None:
    """Write one graph of `model` to `path`, traced on `inputs`."""
    module = GRAPH_MODULES[graph.name](model).eval()
    args = tuple(inputs[name] for name in graph.inputs)
    with warnings.catch_warnings():  # the exporter's notes on how it names the dynamic axes
        warnings.simplefilter("ignore", UserWarning)
        program = _export(module, args, graph, opset)
    program.save(str(path))


def _export(module: nn.Module, args: tuple, graph: Graph, opset: int | None):
    return torch.onnx.export(
        module,
        args,
        dynamic_shapes=_dynamic_shapes(graph),
        input_names=list(graph.inputs),
        output_names=list(graph.outputs),
        opset_version=opset,
        dynamo=True,
        external_data=False,
        verbose=False,
    )


def run_graph(session, graph: Graph, inputs: dict) -> "numpy.ndarray":  # noqa: F821
    """An onnxruntime session's output for `inputs` (tensors or arrays, by name)."""
    feed = {name: _numpy(inputs[name]) for name in graph.inputs}
    return session.run(list(graph.outputs), feed)[0]


def reference(model, graph: Graph, inputs: dict) -> "numpy.ndarray":  # noqa: F821
    """PyTorch's output of the same graph."""
    with torch.no_grad():
        module = GRAPH_MODULES[graph.name](model)
        return module(*(torch.as_tensor(inputs[name]) for name in graph.inputs)).numpy()


def _numpy(value):
    return value.numpy() if isinstance(value, torch.Tensor) else value


def _session(path: Path):
    try:
        import onnxruntime
    except ImportError:
        raise ImportError(
            'Checking an ONNX export needs onnxruntime: pip install -e ".[onnx]" (or pip install onnxruntime).'
        ) from None
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def export_model(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    atol: float = DEFAULT_ATOL,
    opset: int | None = None,
) -> dict:
    """
    Export the model saved in `model_dir` to ONNX in `out_dir` (see the module docstring) and check each graph with
    onnxruntime against PyTorch on two batches the graph was not traced with (1 pair of 3 tokens, 3 pairs of 7). A
    difference over `atol` raises `ValueError` naming the graph. Returns the manifest written as `onnx_export.json`.
    """
    from transformers import AutoConfig, AutoProcessor

    from .model_paths import check_model_path
    from .modeling_mm_fusion import MMFusionForImageTextClassification, MMFusionForPretraining

    check_model_path(model_dir)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(model_dir)
    heads = {cls.__name__: cls for cls in (MMFusionForImageTextClassification, MMFusionForPretraining)}
    saved = [name for name in (getattr(config, "architectures", None) or ()) if name in heads]
    if not saved:
        raise ValueError(
            f"{model_dir} was saved as {getattr(config, 'architectures', None)}; ONNX export covers the heads "
            f"{', '.join(heads)}."
        )
    from .lora import has_adapter, merge_lora

    # A LoRA run's directory (scripts/train.py --lora): its adapter folded into the weights it was trained on.
    model = (merge_lora(model_dir) if has_adapter(model_dir) else heads[saved[0]].from_pretrained(model_dir)).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    size = processor.image_processor.size
    image_size = size["height"] if isinstance(size, dict) else int(size)

    out_dir.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out_dir)
    for item in model_dir.iterdir():  # the config, its remote code and the model card
        if item.is_file() and (item.name in COPIED or item.suffix == ".py"):
            shutil.copy2(item, out_dir / item.name)

    traced = example_inputs(model, image_size)
    checks = [
        example_inputs(model, image_size, batch=1, length=3, seed=1),
        example_inputs(model, image_size, batch=3, length=7, seed=2),
    ]
    manifest = {"head": type(model).__name__, "image_size": image_size, "atol": atol, "graphs": {}}
    if hasattr(model, "logit_scale"):  # the contrastive temperature, which zero-shot scores read
        manifest["logit_scale"] = float(model.logit_scale.detach())
    for graph in graphs_for(model):
        path = out_dir / graph.file
        export_graph(model, graph, path, traced, opset)
        session = _session(path)
        difference = max(
            float(abs(run_graph(session, graph, inputs) - reference(model, graph, inputs)).max()) for inputs in checks
        )
        if difference > atol:
            raise ValueError(
                f"The ONNX graph {graph.file} differs from PyTorch by up to {difference:.3g} (over atol={atol}) on "
                "the check batches; the export is not usable as it is."
            )
        manifest["graphs"][graph.name] = {
            "file": graph.file,
            "inputs": list(graph.inputs),
            "outputs": list(graph.outputs),
            "max_abs_difference": difference,
        }
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    card = out_dir / "README.md"
    if card.is_file():
        card.write_text(card.read_text().rstrip("\n") + "\n\n" + onnx_card_section(manifest))
    return manifest


def onnx_card_section(manifest: dict) -> str:
    """The section the exported directory's model card gains: its graphs and how to serve them."""
    rows = "\n".join(
        f"| `{g['file']}` | {', '.join(g['inputs'])} | {', '.join(g['outputs'])} | {g['max_abs_difference']:.1e} |"
        for g in manifest["graphs"].values()
    )
    return (
        "## ONNX\n\n"
        "This directory holds the model exported to ONNX by `python -m mm_fusion.export` (dynamic batch and text "
        f"length, {manifest['image_size']} px images as uint8), with the processor and `onnx_export.json`:\n\n"
        "| graph | inputs | outputs | largest difference from PyTorch |\n|---|---|---|---|\n"
        f"{rows}\n\n"
        "```python\nfrom transformers import AutoProcessor, pipeline\nfrom mm_fusion import MMFusionOnnxModel\n\n"
        'model = MMFusionOnnxModel.from_pretrained("path/to/this/directory")\n'
        'processor = AutoProcessor.from_pretrained("path/to/this/directory")\n'
        "```\n\nThen `pipeline(task, model=model, processor=processor)` for the pipelines above (onnxruntime: "
        '`pip install "mm-fusion[onnx]"`).\n'
    )


@dataclass
class ExportArguments:
    model_dir: str = field(
        metadata={"positional": True, "help": "A directory a model was saved to (scripts/train.py's --output_dir)."}
    )
    out_dir: str = field(
        metadata={"positional": True, "help": "Where the .onnx graphs, the processor files and onnx_export.json go."}
    )
    atol: float = field(default=DEFAULT_ATOL, metadata={"help": "The largest difference from PyTorch allowed."})
    opset: int | None = field(default=None, metadata={"help": "The ONNX opset; None: the exporter's."})


def main(argv: list[str] | None = None) -> int:
    parser = ScriptArgumentParser(
        ExportArguments,
        prog=command_name("mm_fusion.export"),
        description="Export a saved mm_fusion model to ONNX (dynamic batch and text length), checked with "
        "onnxruntime against PyTorch; the processor files are saved beside the graphs.",
    )
    (args,) = parser.parse_command_line(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()  # an error is then the one line below
    try:
        manifest = export_model(args.model_dir, args.out_dir, atol=args.atol, opset=args.opset)
    except (FileNotFoundError, ValueError, ImportError) as error:
        parser.fail(error)
    for entry in manifest["graphs"].values():
        print(
            f"{Path(args.out_dir) / entry['file']}: {', '.join(entry['inputs'])} -> {', '.join(entry['outputs'])} "
            f"(max difference from PyTorch {entry['max_abs_difference']:.2g})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
