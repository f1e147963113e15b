"""
Where the time of the default training step goes, and what each speed lever buys, in one process: the
model, batches and optimizer of `scripts/train.py` with no arguments (`mm_fusion.training.run.setup_run`).

1. **Breakdown**: each part of the step (the tower's stem, each stage, each stage's read of the question, the text
   tower, the feature-map tokens, the fusion block, the head and loss) run alone on the inputs it gets in a real step,
   forward and forward + backward, with the optimizer step and the collator's time per batch; once with every lever off
   (`before`) and once as it ships (`shipped`).
2. **Levers**: whole training steps, the variants interleaved step by step (A B C A B C ...) so that the machine's
   drift falls on all alike: `before`; `+share` (the stem and first stage once per distinct image of the batch);
   `+channels_last`; `+factored_read` (a stage's read factored through the text's side where that pays) =
   `shipped`; and apart,
   `bf16` (the shipped step under CPU autocast), `compile` (`torch.compile` of the shipped model, its compile time
   reported) and `one_thread` (the shipped step on one torch thread instead of the machine's cores).
3. **The reads** alone at each stage's shape (batch 64): factored against projected (SDPA), for texts of 8 to 64
   tokens (where `MMFusionStageRead._factored_pays` draws the line).
4. **Evaluation's share**: one evaluation over the test questions against the training epochs around it.

The process keeps freed memory for reuse (`benchmarking.reuse_freed_memory`): without it, this loop faulted in fresh
memory every step (~1,300 page faults, 17 ms a step) where `scripts/train.py`'s `Trainer` faults none. Each variant's
page faults a step are reported.

    python scripts/benchmarks/profile_training_step.py   # ~6 minutes on 2 cores

Writes scripts/benchmarks/results/profile_training_step.{json,md} and prints the tables.
"""

import contextlib
import resource
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch
from benchmarking import RESULTS, machine, markdown_table, reuse_freed_memory, write_report
from transformers import HfArgumentParser

from mm_fusion.training.run import setup_run
from mm_fusion.vision_towers import MMFusionStageRead


LEVERS = ("share", "channels_last", "factored_read")
LADDER = {  # the levers each variant has on, cumulatively
    "before": (),
    "+share": ("share",),
    "+channels_last": ("share", "channels_last"),
    "shipped": LEVERS,
}
EXTRA = ("bf16", "compile", "one_thread")


@dataclass
class ProfileArguments:
    variants: str = field(
        default=",".join([*LADDER, *EXTRA]), metadata={"help": f"Comma-separated, from {[*LADDER, *EXTRA]}."}
    )
    steps: int = field(default=60, metadata={"help": "Timed steps per variant (interleaved), after warm-up steps."})
    repeats: int = field(default=15, metadata={"help": "Timed repeats of each part in the breakdown."})
    read_tokens: str = field(default="8,12,16,20,32,64", metadata={"help": "Text lengths of the read benchmark."})
    evaluate: bool = field(default=True, metadata={"help": "Time one evaluation over the test questions."})
    train_args: str = field(
        default="", metadata={"help": "More scripts/train.py arguments, as one string (a smaller run for a test)."}
    )
    output: str = field(default=str(RESULTS / "profile_training_step"), metadata={"help": "Path stem."})


@contextlib.contextmanager
def levers(model, on: tuple[str, ...]):
    """The model as it runs with only these levers on. `share` is applied to the batches ([`batch_for`])."""
    handles = []
    if "channels_last" not in on:  # the tower's input back to the default (NCHW) layout

        def contiguous(module, args, kwargs):
            kwargs["pixel_values"] = kwargs["pixel_values"].contiguous()
            return args, kwargs

        handles.append(model.mm_fusion.vision_model.register_forward_pre_hook(contiguous, with_kwargs=True))
    rule = MMFusionStageRead._factored_pays
    if "factored_read" not in on:
        MMFusionStageRead._factored_pays = never  # every read projected, through SDPA
    try:
        yield
    finally:
        MMFusionStageRead._factored_pays = rule
        for handle in handles:
            handle.remove()


def never(*args) -> bool:
    return False


def batch_for(batch: dict, on: tuple[str, ...]) -> dict:
    """Without `share`, one copy of its image per question, as the tower ran before."""
    if "share" in on:
        return batch
    unshared = {k: v for k, v in batch.items() if k != "image_index"}
    unshared["pixel_values"] = batch["pixel_values"][batch["image_index"]]
    return unshared


def median_ms(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def parts(model) -> dict:
    """The step's parts, by name: the modules of the default model (a ResNet backbone tower whose stages read)."""
    fusion = model.mm_fusion
    tower = fusion.vision_model
    named = {"stem": tower.embedder}
    for i, (stage, read) in enumerate(zip(tower.encoder.stages, fusion.vision_encoder.vision_text_attention.reads)):
        named[f"stage {i + 1}"] = stage
        named[f"stage {i + 1} read"] = read
    named.update(
        {"text tower": fusion.text_model, "tokens": fusion.vision_encoder.feature_map_tokens, "fusion": fusion.encoder,
         "head": model.classifier}
    )  # fmt: skip
    return named


def breakdown(model, optimizer, batch: dict, on: tuple[str, ...], repeats: int) -> list[dict]:
    """Each part run alone on the inputs it had in one step with these levers, forward and forward + backward."""
    named = parts(model)
    captured = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda m, args, kwargs, name=name: captured.setdefault(name, (args, kwargs)), with_kwargs=True
        )
        for name, module in named.items()
    ]
    with levers(model, on):
        model(**batch_for(batch, on)).loss.backward()
    for hook in hooks:
        hook.remove()
    optimizer.zero_grad(set_to_none=True)

    def detached(x, needs_grad: bool):
        if isinstance(x, torch.Tensor):
            y = x.detach()
            return y.requires_grad_(True) if needs_grad and y.is_floating_point() else y
        if isinstance(x, (list, tuple)):
            return type(x)(detached(v, needs_grad) for v in x)
        if isinstance(x, dict):
            return {k: detached(v, needs_grad) for k, v in x.items()}
        return x

    def tensors(x):
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, (list, tuple)):
            return [t for v in x for t in tensors(v)]
        if hasattr(x, "values"):
            return [t for v in x.values() for t in tensors(v)]
        return []

    rows = []
    with levers(model, on):
        for name, module in named.items():
            args, kwargs = captured[name]
            # The stem's input is the pixels (no gradient); every other part's inputs are activations.
            args, kwargs = detached(args, name != "stem"), detached(kwargs, name != "stem")
            rows_in = next(t for t in tensors((args, kwargs)) if t.dim() > 1).shape[0]

            def forward():
                with torch.no_grad():
                    module(*args, **kwargs)

            def forward_backward():
                out = module(*args, **kwargs)
                sum(t.float().sum() for t in tensors(out) if t.requires_grad).backward()
                module.zero_grad(set_to_none=True)

            rows.append(
                {"part": name, "rows": rows_in, "forward_ms": median_ms(forward, repeats),
                 "forward_backward_ms": median_ms(forward_backward, repeats)}
            )  # fmt: skip
    return rows


def step_times(model, optimizer, batches: list[dict], variants: list[str], steps: int) -> dict:
    """Whole training steps, the variants interleaved step by step; seconds of compiling for `compile`."""
    compiled, compile_s = None, None
    if "compile" in variants:
        compiled = torch.compile(model)
        start = time.perf_counter()
        for batch in batches[:3]:
            run_step(compiled, optimizer, batch, "compile")
        compile_s = time.perf_counter() - start
    times = {v: [] for v in variants}
    faults = {v: 0 for v in variants}  # minor page faults (fresh memory touched), summed over the timed steps
    for variant in variants:  # warm-up
        for batch in batches[:2]:
            run_step(compiled if variant == "compile" else model, optimizer, batch, variant)
    for i in range(steps):
        batch = batches[i % len(batches)]
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for variant in order:
            start, faulted = time.perf_counter(), minor_faults()
            run_step(compiled if variant == "compile" else model, optimizer, batch, variant)
            times[variant].append(time.perf_counter() - start)
            faults[variant] += minor_faults() - faulted
    return {"times": times, "compile_s": compile_s, "faults": {v: n / steps for v, n in faults.items()}}


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_step(module, optimizer, batch: dict, variant: str) -> None:
    on = LADDER.get(variant, LEVERS)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if variant == "bf16" else contextlib.nullcontext()
    model = getattr(module, "_orig_mod", module)
    threads = torch.get_num_threads()
    if variant == "one_thread":
        torch.set_num_threads(1)
    try:
        with levers(model, on), autocast:
            loss = module(**batch_for(batch, on)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)


def read_benchmark(token_counts: list[int], repeats: int) -> list[dict]:
    """Each stage's read of the default model (batch 64; 16 x 16 cells of 24 channels, 8 x 8 of 48, 4 x 4 of 96; text
    width 96, 4 heads), forward + backward, factored against projected (SDPA), for texts of these lengths (a quarter
    of them padding); and which of the two `_factored_pays` picks."""
    torch.manual_seed(0)
    rows = []
    rule = MMFusionStageRead._factored_pays
    try:
        for channels, side in ((24, 16), (48, 8), (96, 4)):
            read = MMFusionStageRead(channels, 96, 4)
            hidden = torch.randn(64, channels, side, side).contiguous(memory_format=torch.channels_last)
            hidden.requires_grad_(True)
            for tokens in token_counts:
                text = torch.randn(64, tokens, 96, requires_grad=True)
                keep = torch.arange(tokens)[None, :] < torch.full((64, 1), max(1, tokens * 3 // 4))
                mask = keep[:, None, None, :]
                row = {"cells": f"{side} x {side}", "channels": channels, "tokens": tokens,
                       "picked": "factored" if rule(read, side * side, channels, tokens) else "projected"}  # fmt: skip
                for name, choice in (("factored_ms", True), ("projected_ms", False)):
                    MMFusionStageRead._factored_pays = lambda *args, choice=choice: choice
                    row[name] = median_ms(lambda: read(hidden, text, mask).sum().backward(), repeats)
                rows.append(row)
    finally:
        MMFusionStageRead._factored_pays = rule
    return rows


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(ProfileArguments).parse_args_into_dataclasses(args=argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in (*LADDER, *EXTRA)]
    if unknown:
        raise ValueError(f"Unknown variants {unknown}; choose from {[*LADDER, *EXTRA]}.")
    info = machine()
    info["reuses_freed_memory"] = reuse_freed_memory()  # as the Trainer's steps do (benchmarking.reuse_freed_memory)
    with tempfile.TemporaryDirectory() as out:
        trainer = setup_run(
            ["--output_dir", out, "--max_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
             "--disable_tqdm", "True", "--report_to", "none", *shlex.split(args.train_args)]
        )  # fmt: skip
        model, optimizer = trainer.model, trainer.create_optimizer()
        model.train()
        loader = trainer.get_train_dataloader()
        batches = []
        for batch in loader:  # the first batch starts the loader; the next 30 time the collator
            batches.append(batch)
            if len(batches) == 1:
                start = time.perf_counter()
            if len(batches) == 31:
                break
        collate_ms = 1000 * (time.perf_counter() - start) / (len(batches) - 1)
        images = statistics.mean(len(b["pixel_values"]) for b in batches)
        tokens = statistics.mean(b["input_ids"].shape[1] for b in batches)

        parts_rows = {
            v: breakdown(model, optimizer, batches[0], LADDER[v], args.repeats) for v in ("before", "shipped")
        }
        model(**batches[0]).loss.backward()  # gradients for the optimizer to step with
        optimizer_ms = median_ms(optimizer.step, args.repeats)
        optimizer.zero_grad(set_to_none=True)
        steps = step_times(model, optimizer, batches, variants, args.steps)
        reads = read_benchmark([int(t) for t in args.read_tokens.split(",")], args.repeats)
        evaluation = None
        if args.evaluate:
            model.eval()
            start = time.perf_counter()
            metrics = trainer.evaluate()
            evaluation = {"seconds": time.perf_counter() - start, "pairs": len(trainer.eval_dataset),
                          "accuracy": metrics.get("eval_accuracy")}  # fmt: skip
            evaluation["train_epoch_seconds"] = statistics.median(
                steps["times"].get("shipped", next(iter(steps["times"].values())))
            ) * len(loader)

    batch_size = len(batches[0]["input_ids"])
    step_rows = []
    base = statistics.median(steps["times"]["before"]) if "before" in steps["times"] else None
    for variant, times in steps["times"].items():
        median = statistics.median(times)
        step_rows.append(
            {"variant": variant, "levers": list(LADDER.get(variant, LEVERS)), "step_ms": 1000 * median,
             "step_ms_min": 1000 * min(times), "step_ms_max": 1000 * max(times),
             "samples_per_second": batch_size / median, "speedup_vs_before": base / median if base else None,
             "minor_faults_per_step": steps["faults"][variant]}
        )  # fmt: skip
    report = {
        "machine": info,
        "batch": {"pairs": batch_size, "distinct_images": images, "text_tokens": tokens, "collate_ms": collate_ms},
        "breakdown": parts_rows,
        "optimizer_ms": optimizer_ms,
        "steps": step_rows,
        "compile_seconds": steps["compile_s"],
        "read": reads,
        "evaluation": evaluation,
    }
    text = markdown(report, args)
    print("\n" + text)
    write_report(args.output, report, text)
    return report


def markdown(report: dict, args) -> str:
    info, batch = report["machine"], report["batch"]
    lines = [
        f"The default training step of `scripts/train.py` (batch {batch['pairs']} questions of "
        f"{batch['distinct_images']:.1f} distinct images, {batch['text_tokens']:.1f} tokens); {info['cores']} cores "
        f"({info['cpu']}, family/model {info['cpu_family_model']}), {info['torch_threads']} torch threads, torch "
        f"{info['torch']}. Medians. Freed memory kept in the process (glibc's thresholds set: "
        f"{'yes' if info.get('reuses_freed_memory') else 'no'}), so that the steps fault in no fresh memory, as "
        "in the Trainer (benchmarking.reuse_freed_memory).",
        "",
        "**Breakdown**: each part alone on the inputs of one step (ms), with every lever off and as shipped; the "
        f"optimizer step {report['optimizer_ms']:.1f} ms, the collator {batch['collate_ms']:.1f} ms a batch.",
        "",
    ]
    before, shipped = report["breakdown"]["before"], report["breakdown"]["shipped"]
    rows = [
        [b["part"], b["rows"], f"{b['forward_ms']:.1f}", f"{b['forward_backward_ms']:.1f}", s["rows"],
         f"{s['forward_ms']:.1f}", f"{s['forward_backward_ms']:.1f}"]
        for b, s in zip(before, shipped)
    ]  # fmt: skip
    total = [sum(r[key] for r in part) for part in (before, shipped) for key in ("forward_ms", "forward_backward_ms")]
    rows.append(["sum", "", f"{total[0]:.1f}", f"{total[1]:.1f}", "", f"{total[2]:.1f}", f"{total[3]:.1f}"])
    header = ["part", "rows (before)", "forward", "fwd + bwd", "rows (shipped)", "forward", "fwd + bwd"]
    lines += [markdown_table(header, rows), ""]
    lines += [f"**Levers**: {args.steps} whole training steps per variant, interleaved step by step.", ""]
    rows = [
        [r["variant"], ", ".join(r["levers"]) or "none", f"{r['step_ms']:.1f} ({r['step_ms_min']:.0f}–"
         f"{r['step_ms_max']:.0f})", f"{r['samples_per_second']:.0f}",
         f"{r['speedup_vs_before']:.2f}x" if r["speedup_vs_before"] else "-", f"{r['minor_faults_per_step']:.0f}"]
        for r in report["steps"]
    ]  # fmt: skip
    header = ["variant", "levers on", "step ms (min–max)", "samples/s", "vs before", "page faults a step"]
    lines += [markdown_table(header, rows), ""]
    if report["compile_seconds"] is not None:
        lines += [f"`torch.compile`: {report['compile_seconds']:.0f} s to compile and run its first 3 steps.", ""]
    lines += ["**The reads**, each stage's alone (batch 64), forward + backward (ms):", ""]
    rows = [
        [r["cells"], r["channels"], r["tokens"], f"{r['factored_ms']:.1f}", f"{r['projected_ms']:.1f}", r["picked"]]
        for r in report["read"]
    ]
    header = ["cells", "channels", "text tokens", "factored", "projected (SDPA)", "`_factored_pays` picks"]
    lines += [markdown_table(header, rows), ""]
    if report["evaluation"]:
        e = report["evaluation"]
        lines += [
            f"**Evaluation**: {e['seconds']:.1f} s for the {e['pairs']} test questions, against "
            f"{e['train_epoch_seconds']:.0f} s of shipped training steps per epoch (steps alone, no data wait).",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
