"""
Benchmark the data pipeline on easy-VQA: mm_fusion's `prepare_dataset` + `ImageTextCollator` (also grouped by length,
and without workers) against the two baselines (`seed`, `run_clip`; scripts/benchmarks/README.md), at each image
size. Each trial runs in a new Python with an empty datasets cache; contenders are interleaved and repeated, and the
table gives medians (min–max) of steady-state samples/s, the cold first epoch, padding and peak memory; a second table
times the start-up of `prepare_dataset` on all of easy-VQA, cold then warm. Method: scripts/benchmarks/README.md.

    python scripts/benchmarks/benchmark_data.py     # the full benchmark (about 9 minutes on 2 cores)
    python scripts/benchmarks/benchmark_data.py --num_samples 512 --repeats 1 --epochs 2 --startup_repeats 1  # a look

Writes scripts/benchmarks/results/benchmark_data.{json,md} and prints the Markdown table.
"""

import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import psutil
from baselines import IMAGENET_MEAN, IMAGENET_STD, run_clip_loader, seed_loader
from benchmarking import RESULTS, machine, markdown_table, median_range, run_in_new_interpreter, spread, write_report
from transformers import HfArgumentParser


PIPELINES = ("seed", "run_clip", "mm_fusion", "mm_fusion_grouped", "mm_fusion_no_workers")


@dataclass
class BenchmarkArguments:
    image_sizes: list[int] = field(default_factory=lambda: [224, 64], metadata={"help": "Image sizes to compare at."})
    pipelines: list[str] = field(default_factory=lambda: list(PIPELINES), metadata={"help": "Contenders to run."})
    num_samples: int = field(default=4096, metadata={"help": "Questions drawn (at random) from easy-VQA train."})
    epochs: int = field(default=3, metadata={"help": "Epochs per trial; epochs 2+ give the steady state."})
    repeats: int = field(default=3, metadata={"help": "Trials per contender and image size."})
    startup_repeats: int = field(default=3, metadata={"help": "Cold/warm start-up pairs per image size."})
    batch_size: int = field(default=32, metadata={"help": "Batch size of every DataLoader."})
    num_workers: int = field(default=os.cpu_count() or 1, metadata={"help": "DataLoader workers (default: cores)."})
    output: str = field(default=str(RESULTS / "benchmark_data"), metadata={"help": "Writes OUTPUT.json, OUTPUT.md."})
    seed: int = field(default=0, metadata={"help": "Seed of the question sample and of the loaders' shuffling."})


def _pss(pid: int) -> int:
    """
    Proportional set size in bytes: pages shared between processes (forked workers, the memory-mapped cache) are
    split between them instead of counted once per process. Read from /proc/PID/smaps_rollup, which is cheap; RSS
    where that is missing.
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return psutil.Process(pid).memory_info().rss


class PeakRSS:
    """
    Samples the summed memory (PSS where available) of this process and its children (the DataLoader workers) every
    `interval` seconds; sparse enough not to slow the pipelines it measures on a 2-core machine.
    """

    def __init__(self, interval: float = 0.25):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        process = psutil.Process()
        while not self._stop.is_set():
            try:
                rss = sum(_pss(p.pid) for p in [process, *process.children(recursive=True)])
            except psutil.Error:
                continue
            self.peak = max(self.peak, rss)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------------------------------------------------
# The contenders. Each returns a DataLoader, and for uint8 batches the normalisation the model applies on its device:
# the baselines' `seed_loader` and `run_clip_loader` (baselines.py), and mm_fusion's.


def prepare_easy_vqa(data, tokenizer, size: int, **options):
    """mm_fusion's preprocessing of easy-VQA rows (a Dataset or the DatasetDict): `prepare_dataset` with easy-VQA's
    columns; `options` go to it."""
    from mm_fusion.data import prepare_dataset

    columns = {"image_column": "image", "text_column": "question", "id_column": "id", "label_column": "answer"}
    return prepare_dataset(data, tokenizer, **columns, image_size=size, **options)


def mm_fusion_loader(dataset, tokenizer, size, args, grouped=False, num_workers=0):
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from mm_fusion.data import ImageTextCollator
    from mm_fusion.vision_encoder import normalize_uint8_pixels

    prepared = prepare_easy_vqa(dataset, tokenizer, size, num_proc=args.num_workers)
    generator = torch.Generator().manual_seed(args.seed)
    sampler = (
        LengthGroupedSampler(args.batch_size, lengths=list(prepared.pairs["length"]), generator=generator)
        if grouped
        else None
    )
    loader = torch.utils.data.DataLoader(
        prepared.pairs,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),  # only when there is a GPU to copy to: on a CPU it only costs
        collate_fn=ImageTextCollator(prepared.images, pad_token_id=tokenizer.pad_token_id),
    )

    def to_model(batch):  # what the model does with uint8 input on its device
        return {**batch, "pixel_values": normalize_uint8_pixels(batch["pixel_values"], IMAGENET_MEAN, IMAGENET_STD)}

    return loader, to_model


# --------------------------------------------------------------------------------------------------------------------


def run_trial(payload: dict) -> dict:
    """
    One trial, in this fresh process (with an empty datasets cache): start-up, then `epochs` epochs through the
    DataLoader. `payload`: pipeline, size, tokenizer (a directory), indices (a JSON file), args (`BenchmarkArguments`).
    """
    import torch
    from transformers import AutoTokenizer

    from mm_fusion.data import load_easy_vqa

    pipeline, size, args = payload["pipeline"], payload["size"], BenchmarkArguments(**payload["args"])
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(payload["tokenizer"])
    with open(payload["indices"]) as f:
        indices = json.load(f)
    with PeakRSS() as rss:
        start = time.perf_counter()
        if pipeline == "seed":
            import easy_vqa

            questions, answers, image_ids = easy_vqa.get_train_questions()
            paths, names = easy_vqa.get_train_image_paths(), easy_vqa.get_answers()
            rows = {
                "image": [paths[image_ids[i]] for i in indices],
                "question": [questions[i] for i in indices],
                "answer": [names.index(answers[i]) for i in indices],
            }
            loader, to_model = seed_loader(rows, tokenizer, size, args)
        else:
            dataset = load_easy_vqa(["train"])["train"].select(indices)
            if pipeline == "run_clip":
                loader, to_model = run_clip_loader(dataset, tokenizer, size, args)
            else:
                workers = 0 if pipeline.endswith("no_workers") else args.num_workers
                loader, to_model = mm_fusion_loader(
                    dataset, tokenizer, size, args, pipeline.endswith("grouped"), workers
                )
        startup = time.perf_counter() - start
        epoch_times, samples, tokens, padded = [], 0, 0, 0
        for _ in range(args.epochs):
            start, samples = time.perf_counter(), 0
            for batch in loader:
                samples += batch["input_ids"].shape[0]
                tokens += batch["attention_mask"].numel()
                padded += int((batch["attention_mask"] == 0).sum())
            epoch_times.append(time.perf_counter() - start)
    normalise_ms = 0.0
    if batch["pixel_values"].dtype == torch.uint8:  # mm_fusion: time what the model does on its device, here on CPU
        start = time.perf_counter()
        for _ in range(20):
            ready = to_model(batch)
        normalise_ms = (time.perf_counter() - start) / 20 * 1000
        assert ready["pixel_values"].dtype == torch.float32
    assert batch["pixel_values"].shape[-1] == size
    return {
        "pipeline": pipeline,
        "image_size": size,
        "samples_per_epoch": samples,
        "startup_s": startup,
        "epoch_s": epoch_times,
        "steady_samples_per_s": statistics.median(samples / t for t in epoch_times[1:]),
        "normalise_ms_per_batch": normalise_ms,
        "cold_first_epoch_s": startup + epoch_times[0],
        "padded_token_fraction": padded / tokens,
        "peak_rss_mib": rss.peak / 2**20,
    }


def run_startup(payload: dict) -> dict:
    """
    Time `prepare_dataset` on all of easy-VQA (train + test) in this fresh process: cold or warm, by its datasets
    cache. `payload`: size, tokenizer (a directory), args (`BenchmarkArguments`).
    """
    from transformers import AutoTokenizer

    from mm_fusion.data import load_easy_vqa

    tokenizer = AutoTokenizer.from_pretrained(payload["tokenizer"])
    start = time.perf_counter()
    data = load_easy_vqa()
    prepared = prepare_easy_vqa(data, tokenizer, payload["size"], num_proc=payload["args"]["num_workers"])
    return {
        "startup_s": time.perf_counter() - start,
        "pairs": sum(len(s) for s in prepared.pairs.values()),
        "images": len(prepared.images),
    }


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(BenchmarkArguments).parse_args_into_dataclasses(args=argv)
    unknown = set(args.pipelines) - set(PIPELINES)
    if unknown:
        raise ValueError(f"Unknown pipelines {sorted(unknown)}; choose from {list(PIPELINES)}.")
    import easy_vqa

    from mm_fusion import train_tokenizer

    work = tempfile.mkdtemp(prefix="mm_fusion_benchmark_")
    questions = easy_vqa.get_train_questions()[0]
    tokenizer_dir = os.path.join(work, "tokenizer")
    train_tokenizer(questions).save_pretrained(tokenizer_dir)
    indices = np.random.default_rng(args.seed).choice(len(questions), args.num_samples, replace=False).tolist()
    indices_file = os.path.join(work, "indices.json")
    with open(indices_file, "w") as f:
        json.dump(indices, f)

    trials, startups = [], []
    for size in args.image_sizes:
        for repeat in range(args.repeats):
            order = args.pipelines[repeat % len(args.pipelines) :] + args.pipelines[: repeat % len(args.pipelines)]
            for pipeline in order:
                payload = {"pipeline": pipeline, "size": size, "tokenizer": tokenizer_dir, "indices": indices_file}
                payload["args"] = asdict(args)
                cache = tempfile.mkdtemp(dir=work)  # empty: the trial's start-up includes any preprocessing
                result = run_in_new_interpreter("benchmark_data:run_trial", payload, datasets_cache=cache)
                trials.append(result)
                steady, cold = result["steady_samples_per_s"], result["cold_first_epoch_s"]
                print(
                    f"{size}px {pipeline:>17}: {steady:7.0f} samples/s steady, cold first epoch {cold:6.1f} s, "
                    f"padded {result['padded_token_fraction']:.1%}",
                    flush=True,
                )
        for _ in range(args.startup_repeats):
            cache = tempfile.mkdtemp(dir=work)
            payload = {"size": size, "tokenizer": tokenizer_dir, "args": asdict(args)}
            cold = run_in_new_interpreter("benchmark_data:run_startup", payload, datasets_cache=cache)
            warm = run_in_new_interpreter("benchmark_data:run_startup", payload, datasets_cache=cache)  # cache of cold
            startups.append({"image_size": size, "cold_s": cold["startup_s"], "warm_s": warm["startup_s"], **cold})
            print(f"{size}px start-up: cold {cold['startup_s']:.2f} s, warm {warm['startup_s']:.2f} s", flush=True)

    rows = []
    for size in args.image_sizes:
        seed = [t["steady_samples_per_s"] for t in trials if t["image_size"] == size and t["pipeline"] == "seed"]
        clip = [t["steady_samples_per_s"] for t in trials if t["image_size"] == size and t["pipeline"] == "run_clip"]
        for pipeline in args.pipelines:
            mine = [t for t in trials if t["image_size"] == size and t["pipeline"] == pipeline]
            speed = [t["steady_samples_per_s"] for t in mine]
            rows.append(
                {
                    "image_size": size,
                    "pipeline": pipeline,
                    "steady_samples_per_s": spread(speed),
                    "vs_seed": statistics.median(speed) / statistics.median(seed) if seed else None,
                    "vs_run_clip": statistics.median(speed) / statistics.median(clip) if clip else None,
                    "cold_first_epoch_s": spread([t["cold_first_epoch_s"] for t in mine]),
                    "startup_s": spread([t["startup_s"] for t in mine]),
                    "padded_token_fraction": statistics.median(t["padded_token_fraction"] for t in mine),
                    "normalise_ms_per_batch": statistics.median(t["normalise_ms_per_batch"] for t in mine),
                    "peak_rss_mib": spread([t["peak_rss_mib"] for t in mine]),
                }
            )
    startup_rows = []
    for size in args.image_sizes:
        runs = [s for s in startups if s["image_size"] == size]
        if runs:
            startup_rows.append(
                {
                    "image_size": size,
                    "cold_s": spread([s["cold_s"] for s in runs]),
                    "warm_s": spread([s["warm_s"] for s in runs]),
                    "speedup": statistics.median(s["cold_s"] / s["warm_s"] for s in runs),
                    "pairs": runs[0]["pairs"],
                    "images": runs[0]["images"],
                }
            )

    info = machine() | {"memory_gib": round(psutil.virtual_memory().total / 2**30)}
    report = {"arguments": asdict(args), "machine": info, "rows": rows, "startup": startup_rows}
    report |= {"trials": trials, "startup_trials": startups}
    table = markdown(report)
    print("\n" + table)
    write_report(args.output, report, table)
    return report


def markdown(report: dict) -> str:
    """The tables of a report (`machine` as `benchmarking.machine()` gives it, or the text reports before it had)."""
    args, info = report["arguments"], report["machine"]
    if not isinstance(info, str):
        info = f"{info['cores']} cores, {info['memory_gib']} GiB, torch {info['torch']}"
    header = ["size", "pipeline", "steady samples/s", "vs seed", "vs run_clip", "cold first epoch (s)"]
    header += ["padded tokens", "peak memory (MiB)", "model-side normalisation on CPU (ms/batch)"]
    cells = []
    for r in report["rows"]:
        ratio = {k: f"{r[k]:.1f}x" if r[k] is not None else "–" for k in ("vs_seed", "vs_run_clip")}
        cells.append(
            [r["image_size"], r["pipeline"], median_range(r["steady_samples_per_s"]), ratio["vs_seed"]]
            + [ratio["vs_run_clip"], median_range(r["cold_first_epoch_s"], 1), f"{r['padded_token_fraction']:.1%}"]
            + [median_range(r["peak_rss_mib"]), f"{r['normalise_ms_per_batch']:.1f}"]
        )
    lines = [
        f"easy-VQA, {args['num_samples']} questions, batch {args['batch_size']}, {args['num_workers']} workers, "
        f"{args['epochs']} epochs x {args['repeats']} interleaved trials; {info}. Medians (min–max).",
        "",
        markdown_table(header, cells),
    ]
    if report["startup"]:
        header = ["size", "pairs", "distinct images", "first start-up (s)", "second start-up (s)", "speed-up"]
        cells = [
            [r["image_size"], r["pairs"], r["images"], median_range(r["cold_s"], 2), median_range(r["warm_s"], 2)]
            + [f"{r['speedup']:.0f}x"]
            for r in report["startup"]
        ]
        lines += [
            "",
            "Start-up of `prepare_dataset` on all of easy-VQA (load + validate + preprocess; new process each time):",
            "",
            markdown_table(header, cells),
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
