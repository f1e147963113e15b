"""
LoRA adapters for MMFusion models, with peft (`pip install -e ".[lora]"`).

`scripts/train.py --lora` trains low-rank adapters on the parts named in `--lora_parts` and keeps every other weight
of the model it starts from frozen:

- `vision`: LoRA adapters on the vision tower: on the attention's query and value of a transformer tower (ViT, CLIP),
  on every `nn.Linear` and every ungrouped `nn.Conv2d` of a convolutional one (its depthwise convolutions stay frozen,
  and all of them in a MobileNet with `tf_padding`, whose forward reads attributes peft's wrapper hides). Its
  BatchNorm layers train fully: their running statistics follow the new images (a few numbers per channel), and in the
  frozen model they would drift unsaved.
- `text`: LoRA adapters on the text tower's attention query and value (BERT / MiniLM: `query`, `value`).
- `fusion`: LoRA adapters on the fusion block's attention query and value (`q_proj`, `v_proj`).

These are `--lora_target_modules query_value`, the default, as the LoRA paper (Hu et al. 2021, arXiv:2106.09685) and
peft's defaults for these models do. `--lora_target_modules all` adapts every layer LoRA can adapt (every `nn.Linear`
and ungrouped `nn.Conv2d`: BERT's `key` and `dense` too, the fusion block's `k_proj`, `out_proj`, MLPs and bridges),
and names adapt those layers (`query,value` for BERT, `q_proj,v_proj` for transformers 5's ViT and the fusion block).
Fewer adapters learn less per step, so `--lora` trains query and value at 2e-3 and every layer at 1e-3 unless
`--learning_rate` is given. At ViT-B/16 + BERT-base size a step adapting query and value took 0.94-1.05x full
fine-tuning's over four runs, every layer 1.13-1.32x; on the MobileNetV2 + MiniLM easy-VQA composition query and value
came within 0.005 of full fine-tuning's accuracy on seeds 42 and 1, every layer within 0.0035 on seed 42
(scripts/benchmarks/RESULTS.md, `benchmark_lora.py`, `benchmark_lora_memory.py`).

A tower left out of `--lora_parts` stays frozen. The fusion block left out of it trains fully, and so do the layers
beside it (the contrastive `visual_projection` / `text_projection`, FiLM maps) and the heads (`classifier`,
`itm_head`), which are new for a new task: peft's `modules_to_save`. The default, `vision,text`, adapts pretrained
towers and trains the fusion block they are composed with, which starts from random weights (LoRA on a random matrix
only moves it in a low-rank subspace). Pretraining's `logit_scale` is a lone parameter that peft cannot save, so it
stays at its starting value.

`--lora` turns on gradient checkpointing (`--lora_gradient_checkpointing`, default True) for every second layer of
the towers and the fusion block (Trainer's `activation_checkpointing_kwargs` `every_n_layers`, 2 unless given): the
frozen towers keep as many activations for the backward as full fine-tuning does (each adapter's `lora_A` keeps its
layer's input, the tensor a trained Linear keeps for its own gradient), so without it the adapters save only the
optimizer states and gradients of the frozen weights. Checkpointing every layer saves more memory than LoRA needs for
more time a step: at ViT-B/16 + BERT-base size with adapters on query and value, 0.41x full fine-tuning's peak memory
at 1.14x its step time, against 0.49x at 0.94-1.05x for every second layer. On a Linux CPU it also gives freed
memory back to the system (`--release_freed_memory`), without which glibc keeps what each step frees and the
process's peak stays near full fine-tuning's (scripts/benchmarks/RESULTS.md, `benchmark_lora_memory.py`).

A run's `--output_dir` holds the model it started from (`config.json`, `model.safetensors`, the processor and code)
and the adapter beside it (`adapter_config.json`, `adapter_model.safetensors`): `from_pretrained` and `pipeline(...)`
load the two together (transformers' peft integration), and [`merge_lora`] folds the adapter into the weights
(`python -m mm_fusion.lora MODEL_DIR OUT_DIR`, or `mm-fusion-merge-lora MODEL_DIR OUT_DIR`).
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .cli import ScriptArgumentParser, command_name


LORA_PARTS = ("vision", "text", "fusion")
# Each part's module, by its path in the bare model.
TOWERS = {"vision": "vision_encoder.vision_model", "text": "text_model", "fusion": "encoder"}
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def parse_parts(parts: str | list[str]) -> list[str]:
    """`"vision,text"` -> `["vision", "text"]`, each checked."""
    names = [p.strip() for p in parts.split(",")] if isinstance(parts, str) else list(parts)
    names = [p for p in names if p]
    wrong = [p for p in names if p not in LORA_PARTS]
    if wrong or not names:
        raise ValueError(f"--lora_parts takes some of {', '.join(LORA_PARTS)}, comma-separated; got {parts!r}.")
    return names


# Layers beside the towers that run inside the vision tower's forward, through hooks that call their sublayers, not
# through their own forward: peft's `modules_to_save` copy of one of them would never be called.
CALLED_BY_HOOKS = ("vision_encoder.vision_film", "vision_encoder.vision_text_attention")


def _beside_towers(body: nn.Module):
    """The bare model's parts by path: its children, with the vision encoder's parts in place of the encoder."""
    for name, child in body.named_children():
        if name == "vision_encoder":
            yield from ((f"{name}.{n}", c) for n, c in child.named_children())
        else:
            yield name, child


def _weighted(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _leaf_with_weights(module: nn.Module) -> bool:
    return not list(module.children()) and next(module.parameters(False), None) is not None


def _adaptable(module: nn.Module) -> bool:
    """Layers LoRA can adapt: Linear, and convolutions without groups (peft's Conv2d LoRA is ungrouped)."""
    return isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.groups == 1)


# The layers `--lora_target_modules query_value` adapts where a part has them: the attention's query and value (BERT's
# names, then those of transformers 5's ViT / CLIP and of the fusion block), as the LoRA paper did and as peft's
# defaults for these models do. A part without them (a convolutional tower) has every layer LoRA can adapt adapted.
ATTENTION_QUERY_VALUE = ("query", "value", "q_proj", "v_proj")
# The name of that choice, and the default of `lora_config` / `add_lora` and `--lora_target_modules`.
QUERY_VALUE = "query_value"


def parse_modules(modules: str | list[str] | None) -> set[str] | str | None:
    """`"query,value"` -> `{"query", "value"}`; None, empty or `"all"` -> None (every layer LoRA can adapt);
    `"query_value"` -> itself ([`ATTENTION_QUERY_VALUE`] where a part has them, every layer elsewhere)."""
    names = {m.strip() for m in modules.split(",")} if isinstance(modules, str) else set(modules or ())
    names = {m for m in names if m}
    if not names or names == {"all"}:
        return None
    return QUERY_VALUE if names == {QUERY_VALUE} else names


def lora_config(
    model,
    parts: str | list[str] = "vision,text",
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    modules: str | list[str] | None = QUERY_VALUE,
):
    """peft's `LoraConfig` for `model` (an MMFusion head): layers of `parts` as `target_modules`, and what trains fully
    (the heads, the fusion block unless adapted, the adapted towers' BatchNorm layers) as `modules_to_save`.
    `modules` chooses the layers: by default `"query_value"`, the attention's query and value where a part has them
    ([`ATTENTION_QUERY_VALUE`]), every layer of a part without them; `"all"` (or None) every layer LoRA can adapt;
    names, by their own name (the last part of a layer's path), comma-separated, each part holding one of them."""
    from peft import LoraConfig

    parts = parse_parts(parts)
    wanted, found = parse_modules(modules), set()
    query_value = wanted == QUERY_VALUE
    if query_value:
        wanted = set(ATTENTION_QUERY_VALUE)
    prefix = model.base_model_prefix
    body = getattr(model, prefix)
    targets, trained = [], []
    for part in parts:
        try:
            tower = body.get_submodule(TOWERS[part])
        except AttributeError:  # late fusion's `encoder` is None
            raise ValueError(f"--lora_parts {part}: this model has no {TOWERS[part]} to adapt.") from None
        # transformers' MobileNet with TensorFlow padding reads each convolution's `stride` in its forward, which
        # peft's LoRA wrapper of a Conv2d does not pass through: its convolutions stay frozen there.
        convolutions = not getattr(getattr(tower, "config", None), "tf_padding", False)
        layers = {
            name: name.rsplit(".", 1)[-1]
            for name, module in tower.named_modules()
            if _adaptable(module) and (convolutions or not isinstance(module, nn.Conv2d))
        }
        names = set(layers.values())
        chosen = None if query_value and not names & wanted else wanted  # a part without attention: every layer
        if chosen is not None and not names & chosen:  # a part left without adapters would train nothing, silently
            raise ValueError(
                f"--lora_target_modules {','.join(sorted(chosen))}: the {part} part (--lora_parts) has no layer of "
                f"these names; its layers LoRA can adapt are named {', '.join(sorted(names)) or 'nothing'}."
            )
        for name, module in tower.named_modules():
            full = f"{prefix}.{TOWERS[part]}.{name}"
            if name in layers:
                if chosen is None or layers[name] in chosen:
                    targets.append(full)
                    found.add(layers[name])
            elif isinstance(module, nn.modules.batchnorm._BatchNorm):
                trained.append(full)
    if wanted is not None and not query_value and wanted - found:
        raise ValueError(
            f"--lora_target_modules {','.join(sorted(wanted))}: no Linear or Conv2d layer named "
            f"{', '.join(sorted(wanted - found))} in --lora_parts {','.join(parts)} (the last part of a layer's path, "
            "e.g. query,value for a BERT tower)."
        )
    # Everything else of the model with weights trains fully: the fusion block unless adapted, the layers beside it
    # (the contrastive projections, FiLM maps...), and the heads.
    adapted = {TOWERS[part] for part in parts} | {TOWERS["vision"], TOWERS["text"]}
    for name, child in _beside_towers(body):
        if name in adapted or not _weighted(child):
            continue
        if name in CALLED_BY_HOOKS:  # peft's copy would not be what the hooks call: copy each layer of it instead
            trained += [
                f"{prefix}.{name}.{leaf}" for leaf, layer in child.named_modules() if _leaf_with_weights(layer)
            ]
            orphans = [n for n, m in child.named_modules() if list(m.children()) and next(m.parameters(False), None)]
            if orphans:
                raise ValueError(f"--lora: {prefix}.{name} holds weights outside its layers ({orphans}).")
        else:
            trained.append(f"{prefix}.{name}")
    trained += [name for name, child in model.named_children() if name != prefix and _weighted(child)]
    if not targets:
        raise ValueError(f"--lora_parts {','.join(parts)}: no Linear or Conv2d layers to adapt there.")
    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, modules_to_save=trained, bias="none"
    )


def add_lora(
    model,
    parts: str | list[str] = "vision,text",
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    modules: str | list[str] | None = QUERY_VALUE,
):
    """`model` wrapped in a peft `PeftModel` with LoRA adapters on `parts` (`modules` of them when given;
    [`lora_config`]); only they, the heads and what trains fully require grad."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(model, parts, r, alpha, dropout, modules))


def has_adapter(model_dir: str | Path) -> bool:
    return all((Path(model_dir) / name).is_file() for name in ADAPTER_FILES)


def starting_model(model_dir: str | Path):
    """The model a LoRA run started from, as saved beside its adapter, without the adapter: `from_pretrained` on the
    directory itself loads the two together (transformers' peft integration), so it reads the directory's other files
    through links in a temporary one (keeping transformers' own key conversion of the saved weights)."""
    import tempfile

    from .configuration_mm_fusion import MMFusionConfig
    from .modeling_mm_fusion import MMFusionForImageTextClassification, MMFusionForPretraining

    model_dir = Path(model_dir).resolve()
    config = MMFusionConfig.from_pretrained(model_dir)
    heads = {cls.__name__: cls for cls in (MMFusionForImageTextClassification, MMFusionForPretraining)}
    head = next((heads[a] for a in config.architectures or [] if a in heads), None)
    if head is None:
        raise ValueError(f"{model_dir}: config.json names no MMFusion head ({config.architectures}).")
    with tempfile.TemporaryDirectory() as plain:
        for item in model_dir.iterdir():
            if item.is_file() and item.name not in ADAPTER_FILES:
                (Path(plain) / item.name).symlink_to(item)
        return head.from_pretrained(plain)


def adapter_in_current_layout(model_dir: str | Path, into: str | Path) -> Path:
    """
    `model_dir`'s adapter written into `into` with the module names the model has now. An adapter saved before the
    vision encoder was a submodule names the vision tower and its parts without `vision_encoder.`: transformers'
    `load_adapter` maps its weights (as `from_pretrained` does a model's, through `SAVED_NAMES` in
    modeling_mm_fusion.py), but peft's `PeftModel.from_pretrained` matches `modules_to_save` and the weights by their
    full names and would leave those modules as they started.
    """
    from peft import PeftConfig
    from safetensors.torch import load_file, save_file
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from .configuration_mm_fusion import MMFusionConfig

    renamings = get_checkpoint_conversion_mapping(MMFusionConfig.model_type)

    def current(name: str) -> str:  # a module or parameter name of a head, without peft's prefix
        for renaming in renamings:  # they match a module's name followed by a dot
            renamed, matched = renaming.rename_source_key(f"{name}.")
            if matched is not None:
                return renamed[:-1]
        return name

    config = PeftConfig.from_pretrained(model_dir)
    config.modules_to_save = [current(name) for name in config.modules_to_save or []] or None
    if not isinstance(config.target_modules, str):  # full names, or the suffixes peft saves in their place
        config.target_modules = {current(name) for name in config.target_modules}
    config.save_pretrained(into)
    prefix = "base_model.model."
    weights = load_file(Path(model_dir) / "adapter_model.safetensors")
    save_file({prefix + current(k.removeprefix(prefix)): v for k, v in weights.items()}, Path(into) / ADAPTER_FILES[1])
    return Path(into)


def merge_lora(model_dir: str | Path):
    """The model saved in `model_dir` with its LoRA adapter folded into the weights: a plain MMFusion model with the
    adapted model's outputs, no peft needed to serve it."""
    import tempfile

    from peft import PeftModel

    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"There is no directory at {model_dir} ({Path(model_dir).absolute()}).")
    if not has_adapter(model_dir):
        raise FileNotFoundError(f"{model_dir} has no LoRA adapter ({', '.join(ADAPTER_FILES)}).")
    base = starting_model(model_dir).eval()
    with tempfile.TemporaryDirectory() as adapter, torch.no_grad():
        return PeftModel.from_pretrained(base, adapter_in_current_layout(model_dir, adapter)).merge_and_unload()


@dataclass
class MergeArguments:
    model_dir: str = field(metadata={"positional": True, "help": "A directory scripts/train.py --lora saved."})
    out_dir: str = field(metadata={"positional": True, "help": "Where to save the merged model."})


def main(argv: list[str] | None = None) -> int:
    parser = ScriptArgumentParser(
        MergeArguments,
        prog=command_name("mm_fusion.lora"),
        description="Fold a LoRA run's adapter (scripts/train.py --lora) into its model's weights and save the result "
        "with its processor: a plain MMFusion model.",
    )
    (args,) = parser.parse_command_line(argv)
    try:
        merged = merge_lora(args.model_dir)
    except (FileNotFoundError, ValueError, ImportError) as error:
        parser.fail(error)
    from transformers import AutoProcessor

    merged.save_pretrained(args.out_dir)
    AutoProcessor.from_pretrained(args.model_dir).save_pretrained(args.out_dir)
    card = Path(args.model_dir) / "README.md"
    if card.is_file():
        (Path(args.out_dir) / "README.md").write_text(card.read_text())
    print(f"merged model in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
