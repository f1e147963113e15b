"""
Benchmark `scripts/train.py --check_data` (a user's table loaded and validated exactly as training would, every image
decoded and checked, then a report instead of training) and how soon a refused table is reported. Every run is
`scripts/train.py` as a user starts it, in a new process with an empty datasets cache and output directory, its
stdout and stderr read line by line as they arrive.

1. Validation throughput. A generated CSV table of `--rows` rows (10,000: 2,500 distinct PNG photos of 64-160 px a
   side, 4 questions each, 5 classes), with a few planted bad rows (missing image, null label, truncated PNG, a file
   that is not an image) for the report to show, checked by `scripts/train.py --task classify ... --check_data` with
   the default model, whose images are 64 px. The wall time from start to exit, `--repeats` times, gives rows/s and
   distinct images/s. One more run of the same command (train.py run by `runpy` with time stamps around the steps of
   `--check_data`) splits its time into start-up (imports, arguments), reading the table, the tokenizer, the model,
   the validation itself and the rest (report, exit).
2. Time to the first error. The training command (no `--check_data`) on a 1,000-row jsonl table whose line 9 is
   malformed: seconds from start to the `error:` line on stderr (and to exit), against `python -c "from transformers
   import TrainingArguments"` (what any transformers script pays before it reads its first argument), interleaved
   A B A B, `--repeats` times each. Target: the ratio of the medians at most 1.2.

    python scripts/benchmarks/benchmark_data_check.py           # 10,000 rows, 5 repeats (minutes): on a quiet machine
    python scripts/benchmarks/benchmark_data_check.py --quick   # 400 rows, one repeat: a look (about 30 s)

Writes scripts/benchmarks/results/data_check.{json,md} and prints the Markdown tables.
"""

import csv
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from benchmarking import RESULTS, ROOT, machine, markdown_table, median_range, offline_env, spread, write_report
from PIL import Image
from transformers import HfArgumentParser


TRAIN = ROOT / "scripts" / "train.py"
CLASSES = ("cat", "dog", "car", "tree", "boat", "house", "bird", "bike", "lamp", "chair")
QUESTIONS = (
    "what is in picture {i}?",
    "which thing does photo {i} show?",
    "name the main object of image {i}",
    "what would you call the subject of shot {i}?",
)
PLANTED = ("missing_image", "null_label", "truncated_png", "not_an_image")  # one kind of bad row each
FULL = {"rows": 10000, "repeats": 5}
QUICK = {"rows": 400, "repeats": 1}
MARK = "benchmark_data_check phase"  # the time stamps of the phase run, on its stderr
TARGET_RATIO = 1.2


@dataclass
class Options:
    rows: int | None = field(
        default=None, metadata={"help": "Rows of the CSV table (default 10,000; 400 with --quick)."}
    )
    rows_per_image: int = field(default=4, metadata={"help": "Questions per distinct image."})
    classes: int = field(default=5, metadata={"help": "Classes of the labels (at most 10)."})
    error_rows: int = field(default=1000, metadata={"help": "Rows of the jsonl table with a malformed line."})
    error_line: int = field(default=9, metadata={"help": "Its malformed line (1-based)."})
    repeats: int | None = field(
        default=None, metadata={"help": "Timed checks, and pairs of error / import runs (default 5; 1 with --quick)."}
    )
    phases: bool = field(default=True, metadata={"help": "One more check run, timed step by step."})
    quick: bool = field(default=False, metadata={"help": "A small run for a test: 400 rows, one repeat."})
    seed: int = field(default=0, metadata={"help": "Seed of the images, texts and labels."})
    output: str = field(default=str(RESULTS / "data_check"), metadata={"help": "Writes OUTPUT.json, OUTPUT.md."})


# --------------------------------------------------------------------------------------------------------------------
# The tables.


def photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A photo-like picture: a smooth two-colour gradient, a few soft ellipses and sensor noise of sigma 6 (so that
    it compresses as a photo does, not as a flat drawing or as pure noise)."""
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    t = ((x * rng.uniform(-1, 1) + y * rng.uniform(-1, 1)) % 1.0)[..., None]
    picture = a * t + b * (1 - t)
    for _ in range(int(rng.integers(2, 6))):
        cx, cy, rx, ry = rng.uniform(0, 1, 2).tolist() + rng.uniform(0.05, 0.3, 2).tolist()
        mask = np.clip(1.5 - ((x - cx) / rx) ** 2 - ((y - cy) / ry) ** 2, 0, 1)[..., None]
        picture = picture * (1 - mask) + rng.uniform(0, 255, 3) * mask
    picture += rng.normal(0, 6, picture.shape)
    return Image.fromarray(np.clip(picture, 0, 255).astype(np.uint8))


def make_tables(folder: Path, options: Options) -> dict:
    """
    Write under `folder` the images (`images/`), the CSV table of part 1 (`pairs.csv`, with the planted bad rows)
    and the jsonl table of part 2 (`broken.jsonl`, line `error_line` malformed). Returns what was written.
    """
    rng = np.random.default_rng(options.seed)
    images = folder / "images"
    images.mkdir(parents=True)
    count = -(-options.rows // options.rows_per_image)  # distinct images
    sizes = rng.integers(64, 161, size=(count, 2))  # width, height
    for i, (width, height) in enumerate(sizes.tolist()):
        photo(rng, width, height).save(images / f"{i:05d}.png")
    labels = CLASSES[: options.classes]

    def row(n: int) -> dict:
        i = n // options.rows_per_image
        text = QUESTIONS[n % options.rows_per_image % len(QUESTIONS)].format(i=i)
        return {"image": f"{i % count:05d}.png", "text": text, "label": labels[int(rng.integers(len(labels)))]}

    rows = [row(n) for n in range(options.rows)]
    # Planted bad rows, spread evenly over the table: one of each kind per 5,000 rows (at least one).
    each = max(1, options.rows // 5000)
    planted = []
    for k in range(each * len(PLANTED)):
        n = int((k + 0.5) * options.rows / (each * len(PLANTED)))
        kind = PLANTED[k % len(PLANTED)]
        if kind == "missing_image":
            rows[n]["image"] = f"missing_{k}.png"
        elif kind == "null_label":
            rows[n]["label"] = ""  # an empty CSV cell: a null label
        elif kind == "truncated_png":
            data = (images / rows[n]["image"]).read_bytes()
            (images / f"truncated_{k}.png").write_bytes(data[: len(data) // 2])
            rows[n]["image"] = f"truncated_{k}.png"
        else:
            (images / f"not_an_image_{k}.png").write_text("this is a text file, not a PNG\n")
            rows[n]["image"] = f"not_an_image_{k}.png"
        planted.append({"line": n + 2, "kind": kind})  # line 1 is the header
    with open(folder / "pairs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["image", "text", "label"])
        writer.writeheader()
        writer.writerows(rows)

    with open(folder / "broken.jsonl", "w") as f:
        for n in range(options.error_rows):
            line = json.dumps(row(n))
            if n + 1 == options.error_line:
                line = line[:-1]  # the closing brace lost, as by a hand edit
            f.write(line + "\n")
    return {
        "rows": options.rows,
        "distinct_images": count,
        "image_sides_px": [int(sizes.min()), int(sizes.max())],
        "image_bytes_median": int(statistics.median(p.stat().st_size for p in images.glob("0*.png"))),
        "classes": len(labels),
        "planted": planted,
    }


def train_command(table: Path, images: Path, output_dir: Path, check_data: bool) -> list[str]:
    """`python scripts/train.py` on a table of image / text / label columns, with the default model."""
    command = [sys.executable, str(TRAIN), "--task", "classify", "--dataset", str(table), "--data_root", str(images)]
    command += ["--image_column", "image", "--text_column", "text", "--label_column", "label"]
    command += ["--validation_split_percentage", "10", "--output_dir", str(output_dir)]
    return command + (["--check_data"] if check_data else [])


def relative(text: str, folder: Path) -> str:
    """`text` with paths under the work `folder` or the checkout written relative to them."""
    return text.replace(str(folder) + "/", "").replace(str(ROOT) + "/", "")


def shown(command: list[str], folder: Path) -> str:
    """A command as a user would type it: `python`, paths relative to the work folder or the checkout."""
    return " ".join(relative("python" if word == sys.executable else word, folder) for word in command)


# --------------------------------------------------------------------------------------------------------------------
# Runs.


def run_streamed(command: list[str], work: Path) -> dict:
    """
    Run `command` in a new process with an empty datasets cache (and unbuffered output, so that a line is seen when
    it is printed), each line of stdout and stderr stamped with the seconds since the start when it arrives; the
    exit code and the wall seconds to exit.
    """
    cache = tempfile.mkdtemp(prefix="datasets_cache_", dir=work)
    env = offline_env(cache) | {"PYTHONUNBUFFERED": "1"}
    lines = {"stdout": [], "stderr": []}
    start = time.monotonic()  # CLOCK_MONOTONIC: the same clock as the phase run's stamps in the child
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def read(stream, name: str) -> None:
        for line in stream:
            lines[name].append((time.monotonic() - start, line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(getattr(process, n), n)) for n in lines]
    for reader in readers:
        reader.start()
    exit_code = process.wait()
    seconds = time.monotonic() - start
    for reader in readers:
        reader.join()
    return {"exit_code": exit_code, "seconds": seconds, "start": start, **lines}


def run_with_phase_marks(argv: list[str]) -> None:
    """
    Run scripts/train.py on `argv` as `python scripts/train.py` does, printing `MARK <step> begin|end <time>` on
    stderr around each step of `--check_data` (`time.monotonic()`): reading the table, the tokenizer, the model and
    the validation (`prepare_pairs`: every row and image checked, the quarantine report written).
    """
    import runpy

    import mm_fusion.training as training
    from mm_fusion.training import data_check

    def marked(module, name: str, step: str) -> None:
        function = getattr(module, name)

        def wrapper(*args, **kwargs):
            print(f"{MARK} {step} begin {time.monotonic()!r}", file=sys.stderr, flush=True)
            try:
                return function(*args, **kwargs)
            finally:
                print(f"{MARK} {step} end {time.monotonic()!r}", file=sys.stderr, flush=True)

        setattr(module, name, wrapper)

    marked(training, "load_training_data", "read_table")  # train.py imports it from here when it runs
    marked(data_check, "build_tokenizer", "tokenizer")
    marked(data_check, "build_model", "model")
    marked(data_check, "prepare_pairs", "validation")
    sys.argv = [str(TRAIN), *argv]
    runpy.run_path(str(TRAIN), run_name="__main__")


def phases_of(run: dict) -> dict:
    """Seconds of each step of a phase run: start-up (to reading the table), the marked steps, and the rest."""
    stamps = {}
    for _, line in run["stderr"]:
        if line.startswith(MARK):
            step, edge, when = line[len(MARK) :].split()
            stamps[step, edge] = float(when) - run["start"]
    steps = ("read_table", "tokenizer", "model", "validation")
    missing = [s for s in steps if (s, "begin") not in stamps or (s, "end") not in stamps]
    if missing:
        tail = "\n".join(line for _, line in run["stderr"][-30:])
        raise RuntimeError(f"the phase run did not mark {missing}:\n{tail}")
    phases = {"start_up": stamps["read_table", "begin"]}
    phases |= {s: stamps[s, "end"] - stamps[s, "begin"] for s in steps}
    phases["rest"] = run["seconds"] - sum(phases.values())  # between the steps, the report and the exit
    return phases


def number(text: str | None) -> int:
    """A count as the report writes it ("10,000"); 0 for none."""
    return int(text.replace(",", "")) if text else 0


def parse_report(stdout: list[str]) -> dict:
    """What the `--check_data` report says: rows left out, distinct usable images, the size they are resized to."""
    text = "\n".join(stdout)
    left_out = re.search(r"^left out: (?:none of|([\d,]+) of) ([\d,]+) rows", text, re.M)
    images = re.search(r"^images: ([\d,]+) distinct usable.*resized to (\d+)x\d+", text, re.M)
    return {
        "left_out": number(left_out.group(1)) if left_out else None,
        "usable_images": number(images.group(1)) if images else None,
        "image_size": int(images.group(2)) if images else None,
        "ok": any(line.startswith("ok: ") for line in stdout),
    }


def first_line_with(lines: list[tuple[float, str]], text: str) -> float | None:
    """Seconds from the start to the first of `lines` that holds `text`; None if none does."""
    return next((when for when, line in lines if text in line), None)


# --------------------------------------------------------------------------------------------------------------------
# The benchmark.


def ended(run: dict, what: str, exit_code: int = 0) -> dict:
    """`run` if it exited with `exit_code`; else a RuntimeError with the tail of its stderr."""
    if run["exit_code"] != exit_code:
        tail = "\n".join(line for _, line in run["stderr"][-30:])
        raise RuntimeError(f"{what} exited {run['exit_code']}, not {exit_code}:\n{tail}")
    return run


def time_check(work: Path, options: Options, table: dict) -> dict:
    """Part 1: `--check_data` on the CSV table, `options.repeats` times, then once step by step (`--phases`)."""
    checks = []
    for repeat in range(options.repeats):
        command = train_command(work / "pairs.csv", work / "images", work / f"check_{repeat}", check_data=True)
        checks.append(ended(run_streamed(command, work), "--check_data"))
        print(f"check {repeat + 1}/{options.repeats}: {checks[-1]['seconds']:.1f} s", flush=True)
    phases = None
    if options.phases:
        command = train_command(work / "pairs.csv", work / "images", work / "check_phases", check_data=True)
        runner = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import benchmark_data_check as b; "
        runner += "b.run_with_phase_marks(sys.argv[1:])"
        run = ended(run_streamed([sys.executable, "-c", runner, *command[2:]], work), "the phase run")
        phases = phases_of(run) | {"wall": run["seconds"]}
        phases["validation_rows_per_second"] = options.rows / phases["validation"]
        print("phases: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
    walls = [run["seconds"] for run in checks]
    report = [relative(line, work) for _, line in checks[0]["stdout"]]
    return {
        "command": shown(train_command(work / "pairs.csv", work / "images", work / "OUT", True), work),
        **table,
        **parse_report(report),
        "exit_codes": [run["exit_code"] for run in checks],
        "wall_seconds": spread(walls),
        "rows_per_second": spread([options.rows / s for s in walls]),
        "images_per_second": spread([table["distinct_images"] / s for s in walls]),
        "report_seconds": spread([run["stdout"][0][0] for run in checks]),  # start to the report's first line
        "phases": phases,
        "report": report,
    }


def time_first_error(work: Path, options: Options) -> dict:
    """Part 2: the training command on the broken jsonl table against importing transformers' TrainingArguments,
    interleaved, `options.repeats` times each."""
    broken = train_command(work / "broken.jsonl", work / "images", work / "refused", check_data=False)
    baseline = [sys.executable, "-c", "from transformers import TrainingArguments"]
    errors, imports = [], []
    for repeat in range(options.repeats):
        run = run_streamed(broken, work)
        errors.append({
            "exit_code": run["exit_code"],
            "seconds": run["seconds"],
            "error_seconds": first_line_with(run["stderr"], "error:"),
            "error_lines": [relative(line, work) for _, line in run["stderr"] if "error:" in line],
            "stderr_lines": len(run["stderr"]),
        })  # fmt: skip
        done = ended(run_streamed(baseline, work), "the import")
        imports.append({"exit_code": done["exit_code"], "seconds": done["seconds"]})
        at = errors[-1]["error_seconds"]
        print(
            f"error {repeat + 1}/{options.repeats}: `error:` line at {'-' if at is None else f'{at:.2f}'} s, exit "
            f"{run['exit_code']} at {run['seconds']:.2f} s; import {imports[-1]['seconds']:.2f} s",
            flush=True,
        )
    at_error = [e["error_seconds"] for e in errors if e["error_seconds"] is not None]
    if not at_error:
        raise RuntimeError(f"no `error:` line on the stderr of {shown(broken, work)}: {errors}")
    baseline_median = statistics.median(i["seconds"] for i in imports)
    ratio = statistics.median(at_error) / baseline_median
    return {
        "command": shown(broken, work),
        "baseline_command": 'python -c "from transformers import TrainingArguments"',
        "error_line": next((line for e in errors for line in e["error_lines"]), None),
        "exit_codes": [e["exit_code"] for e in errors],
        "error_line_counts": [len(e["error_lines"]) for e in errors],
        "stderr_line_counts": [e["stderr_lines"] for e in errors],
        "error_seconds": spread(at_error),
        "exit_seconds": spread([e["seconds"] for e in errors]),
        "baseline_seconds": spread([i["seconds"] for i in imports]),
        "ratio": ratio,
        "exit_ratio": statistics.median(e["seconds"] for e in errors) / baseline_median,
        "target_ratio": TARGET_RATIO,
        "passes": ratio <= TARGET_RATIO,
        "runs": errors,
        "baseline_runs": imports,
    }


def main(argv: list[str] | None = None) -> dict:
    (options,) = HfArgumentParser(Options).parse_args_into_dataclasses(args=argv)
    defaults = QUICK if options.quick else FULL
    options = replace(options, **{k: v for k, v in defaults.items() if getattr(options, k) is None})
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mm_fusion_data_check_") as work:
        work = Path(work)
        table = make_tables(work, options)
        table["generate_seconds"] = time.monotonic() - started
        print(
            f"{options.rows:,} rows, {table['distinct_images']:,} images: {table['generate_seconds']:.0f} s",
            flush=True,
        )
        check = time_check(work, options, table)
        first_error = time_first_error(work, options)
    report = {
        "measured": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "options": asdict(options),
        "check": check,
        "first_error": first_error,
        "benchmark_seconds": time.monotonic() - started,
    }
    text = markdown(report)
    write_report(options.output, report, text)
    print("\n" + text)
    return report


def markdown(report: dict) -> str:
    """The report's tables: the check's throughput, its steps, and the time to the first error."""
    info, options, check, first = report["machine"], report["options"], report["check"], report["first_error"]
    threads = f", OMP_NUM_THREADS={info['OMP_NUM_THREADS']}" if info["OMP_NUM_THREADS"] else ""
    lines = [
        "# `scripts/train.py --check_data`: validation throughput and time to the first error",
        "",
        f"Measured {report['measured']} on {info['cores']} cores ({info['cpu']}, family/model "
        f"{info['cpu_family_model']}){threads}, torch {info['torch']}, transformers {info['transformers']}; "
        f"`python scripts/benchmarks/benchmark_data_check.py{' --quick' if options['quick'] else ''}`. Each run a "
        f"new process with an empty datasets cache; medians (min–max) of {options['repeats']} run"
        f"{'s' if options['repeats'] != 1 else ''}.",
        "",
        f"## Validation: `{check['command']}`",
        "",
        f"{check['rows']:,} rows, {check['distinct_images']:,} distinct PNG photos of {check['image_sides_px'][0]}-"
        f"{check['image_sides_px'][1]} px a side (median {check['image_bytes_median'] / 1024:.0f} KiB), "
        f"{options['rows_per_image']} questions each, {check['classes']} classes, {len(check['planted'])} planted bad "
        f"rows; the default model, images resized to {check['image_size']} px.",
        "",
    ]
    header = ["rows", "distinct images", "left out", "wall s", "rows/s", "images/s", "start to the report s"]
    cells = [[f"{check['rows']:,}", f"{check['distinct_images']:,}", check["left_out"],
              median_range(check["wall_seconds"], 2), median_range(check["rows_per_second"]),
              median_range(check["images_per_second"]), median_range(check["report_seconds"], 2)]]  # fmt: skip
    lines += [markdown_table(header, cells), ""]
    phases = check["phases"]
    if phases:
        steps = ["start_up", "read_table", "tokenizer", "model", "validation", "rest", "wall"]
        lines += [
            "One more run, step by step (seconds; `validation` is `prepare_pairs`: every row and image checked):",
            "",
            markdown_table(steps + ["validation rows/s"],
                           [[f"{phases[s]:.2f}" for s in steps] + [f"{phases['validation_rows_per_second']:.0f}"]]),
            "",
        ]  # fmt: skip
    lines += ["The report of the first run:", "", "```", *check["report"], "```", ""]
    verdict = "PASS" if first["passes"] else "FAIL"
    header = ["run", "to the `error:` line s", "to exit s", "exit codes", "`error:` lines"]
    cells = [
        [f"`{first['command']}`", median_range(first["error_seconds"], 2), median_range(first["exit_seconds"], 2),
         ", ".join(map(str, first["exit_codes"])), ", ".join(map(str, first["error_line_counts"]))],
        [f"`{first['baseline_command']}`", "", median_range(first["baseline_seconds"], 2),
         ", ".join(str(r["exit_code"]) for r in first["baseline_runs"]), ""],
    ]  # fmt: skip
    lines += [
        f"## Time to the first error: a jsonl table of {options['error_rows']:,} rows, line {options['error_line']} "
        "malformed",
        "",
        markdown_table(header, cells),
        "",
        f"`{first['error_line']}`",
        "",
        f"To the `error:` line over the import, ratio of medians: **{first['ratio']:.2f}** (target ≤ "
        f"{first['target_ratio']}: {verdict}); to exit: {first['exit_ratio']:.2f}. Interleaved, error run first.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
