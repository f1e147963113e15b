"""
Activation memory and time of one pretraining optimizer step with the ITC gradient cache (`itc_grad_cache`), against
one big batch and plain gradient accumulation: the recipe's `MMFusionForPretraining` on synthetic batches (16 pairs a
step), with and without ITM; peak saved activations (through `saved_tensors_hooks`), peak RSS growth of the first step
and median step time, each setting in a fresh process, rounds rotated. Method: scripts/benchmarks/README.md.

    python scripts/benchmarks/benchmark_grad_cache.py --threads 1   # 1 thread: steadier times on a shared machine
    python scripts/benchmarks/benchmark_grad_cache.py --rounds 1 --repeats 1 --output /tmp/grad_cache   # a look

Writes scripts/benchmarks/results/grad_cache.json and prints the Markdown table.
"""

import argparse
import statistics
import sys
import time

import torch
from benchmarking import (
    RESULTS,
    machine,
    markdown_table,
    proc_status_kib,
    reset_peak_rss,
    run_in_new_interpreter,
    write_report,
)


MODES = ("plain", "grad_cache", "accumulate")


class SavedTensorMeter:
    """Live and peak bytes of the tensors autograd saves for backward (one count per storage; parameters excluded)."""

    def __init__(self, model: torch.nn.Module):
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages = {}  # data_ptr -> [saved tensors alive, bytes]
        self.current = self.peak = 0

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.parameters or key == 0:
            return tensor
        entry = self.storages.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        # Detached: an op's own output saved with its grad_fn would make a reference cycle the hooks never free.
        return _Saved(self, key, tensor.detach())

    def _release(self, key) -> None:
        entry = self.storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.storages[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x.tensor if isinstance(x, _Saved) else x)


class _Saved:
    """A saved tensor as autograd holds it: freed (and uncounted) when autograd lets go of it."""

    def __init__(self, meter: SavedTensorMeter, key: int, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self):
        self.meter._release(self.key)


def recipe_config(itm_loss_weight: float | None = None):
    """The default recipe's pretraining config (64 px images, text positions for `DataArguments().max_length`)."""
    from mm_fusion.training import DataArguments, ModelArguments, build_config

    model_args = ModelArguments(task="pretrain", vision_tower="vit")  # the ViT tower its results were measured on
    if itm_loss_weight is not None:
        model_args.itm_loss_weight = itm_loss_weight
    return build_config(model_args, 64, model_args.vocab_size, DataArguments().max_length, None)


def synthetic_batch(config, batch_size: int, text_length: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    size = config.vision_config.image_size
    vocab = config.text_config.vocab_size
    return {
        "pixel_values": torch.randint(0, 256, (batch_size, 3, size, size), generator=g, dtype=torch.uint8),
        "input_ids": torch.randint(1, vocab, (batch_size, text_length), generator=g),
        "attention_mask": torch.ones(batch_size, text_length, dtype=torch.long),
    }


def one_step(model, batches: list[dict], mode: str) -> float:
    """The gradients of one optimizer step over `batches`; returns the loss."""
    from mm_fusion.training.grad_cache import train_window

    if mode == "grad_cache":
        return train_window(model, batches).item()
    if mode == "plain" and len(batches) != 1:
        raise ValueError("plain: one batch")
    total = 0.0
    for batch in batches:
        loss = model(**batch, return_loss=True).loss / len(batches)
        loss.backward()
        total += loss.item()
    return total


def measure(
    config, mode: str, batch_size: int, accumulation: int, repeats: int = 3, text_length: int = 16, threads=None
) -> dict:
    """Peak saved-activation bytes, first-step RSS growth and median step time of one setting, in this process."""
    from mm_fusion import MMFusionForPretraining

    if threads:
        torch.set_num_threads(threads)

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    torch.manual_seed(0)
    model = MMFusionForPretraining(config).train()
    # The micro-batches of a step split one batch of 16 (plain B=4: its first 4), so the losses compare.
    full = synthetic_batch(config, max(16, batch_size * accumulation), text_length, seed=0)
    batches = [{k: v[j * batch_size : (j + 1) * batch_size] for k, v in full.items()} for j in range(accumulation)]
    meter = SavedTensorMeter(model)
    rss_before = proc_status_kib("VmRSS")
    rss_reset = reset_peak_rss()
    times = []
    for step in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with meter.hooks():
            loss = one_step(model, batches, mode)
        times.append(time.perf_counter() - start)
        if step == 0:
            hwm = proc_status_kib("VmHWM")
            rss_growth = (hwm - rss_before) / 1024 if rss_reset and hwm and rss_before else None
        assert meter.current == 0, "saved tensors outlived the step"
    return {
        "mode": mode,
        "micro_batch_size": batch_size,
        "accumulation_steps": accumulation,
        "pairs_per_step": batch_size * accumulation,
        "itc_negatives": batch_size * (accumulation if mode != "accumulate" else 1),
        "itm_loss_weight": config.itm_loss_weight,
        "peak_saved_bytes": meter.peak,
        "peak_saved_mib": meter.peak / 2**20,
        "peak_rss_growth_mib": rss_growth,
        "step_s": statistics.median(times[1:]) if repeats else times[0],
        "first_step_s": times[0],
        "torch_threads": torch.get_num_threads(),
        "loss": loss,
    }


SETTINGS = [("plain", 16, 1), ("grad_cache", 4, 4), ("accumulate", 4, 4), ("plain", 4, 1)]


def measure_trial(payload: dict) -> dict:
    """`measure` of one setting, in this fresh process (so that its RSS high-water mark is its own). `payload`:
    `measure`'s keyword arguments, with `itm_loss_weight` for the recipe's config instead of `config`."""
    payload = dict(payload)
    config = recipe_config(payload.pop("itm_loss_weight"))
    return measure(config, **payload)


def markdown(rows: list[dict]) -> str:
    header = ["ITM", "setting", "pairs / step", "ITC negatives", "peak saved activations (MiB)"]
    header += ["peak RSS growth (MiB)", "step (s)", "loss"]
    cells = []
    for r in rows:
        name = (
            f"{r['mode']} B={r['micro_batch_size']}"
            if r["mode"] == "plain"
            else (f"{r['mode']} {r['accumulation_steps']}x{r['micro_batch_size']}")
        )
        rss = f"{r['peak_rss_growth_mib']:.1f}" if r["peak_rss_growth_mib"] is not None else "n/a"
        itm = "on" if r["itm_loss_weight"] else "off"
        numbers = [f"{r['peak_saved_mib']:.1f}", rss, f"{r['step_s']:.3f}", f"{r['loss']:.4f}"]
        cells.append([itm, name, r["pairs_per_step"], r["itc_negatives"], *numbers])
    return markdown_table(header, cells)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="Timed steps per setting (after one warm-up).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds over every setting (fresh process each).")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own).")
    parser.add_argument("--text_length", type=int, default=16)
    parser.add_argument(
        "--output", default=str(RESULTS / "grad_cache"), help="Writes OUTPUT.json (a trailing .json is dropped)."
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = [(itm, *setting) for itm in (1.0, 0.0) for setting in SETTINGS]
    trials = {setting: [] for setting in settings}
    for round_ in range(args.rounds):
        shift = round_ % len(settings)
        for setting in settings[shift:] + settings[:shift]:
            itm, mode, batch_size, accumulation = setting
            payload = dict(mode=mode, batch_size=batch_size, accumulation=accumulation, itm_loss_weight=itm,
                           repeats=args.repeats, text_length=args.text_length, threads=args.threads)  # fmt: skip
            trials[setting].append(run_in_new_interpreter("benchmark_grad_cache:measure_trial", payload))
            print(f"  round {round_ + 1}: {mode} {accumulation}x{batch_size} ITM {itm}", file=sys.stderr)
    rows = []
    for runs in trials.values():
        row = dict(runs[0])
        row["step_s"] = statistics.median(r["step_s"] for r in runs)
        row["step_s_per_round"] = [r["step_s"] for r in runs]
        row["peak_rss_growth_mib_per_round"] = [r["peak_rss_growth_mib"] for r in runs]
        if all(r["peak_rss_growth_mib"] is not None for r in runs):
            row["peak_rss_growth_mib"] = statistics.median(r["peak_rss_growth_mib"] for r in runs)
        rows.append(row)
    config = recipe_config()
    report = {
        "model": {
            "hidden_size": config.fusion_hidden_size,
            "image_size": config.vision_config.image_size,
            "patch_size": config.vision_config.patch_size,
            "vision_layers": config.vision_config.num_hidden_layers,
            "text_layers": config.text_config.num_hidden_layers,
            "fusion_layers": config.num_fusion_layers,
            "fusion_type": config.fusion_type,
            "text_length": args.text_length,
        },
        "machine": machine(),
        "settings": {"rounds": args.rounds, "repeats": args.repeats, "threads": args.threads},
        "method": {
            "peak_saved": "saved_tensors_hooks: bytes of live saved-for-backward storages, parameters excluded",
            "peak_rss_growth": "VmHWM (reset via /proc/self/clear_refs) - VmRSS before, first step, fresh process",
            "step_s": f"median over {args.rounds} rounds of the median of {args.repeats} steps after a warm-up "
            "(forward + backward, no optimizer update)",
        },
        "rows": rows,
    }
    write_report(args.output.removesuffix(".json"), report)
    print(markdown(rows))
    return report


if __name__ == "__main__":
    main()
