"""What the benchmark scripts share: where results go, the machine they ran on, peak memory, trials in fresh
processes, summaries of repeated measurements and the report files.

A trial is a function `module:function` of this folder that takes a JSON-able payload and returns a JSON-able
result. It runs in a fresh process, so that its memory high-water mark, torch thread pool and caches are its own:
`run_in_new_interpreter` starts a new Python for it; `TrialRunner` forks it from a server that has done the imports
once (seconds saved per trial), and falls back to a new interpreter where there is no `os.fork`.
"""

import datetime
import gc
import importlib
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


SCRIPTS = Path(__file__).resolve().parent  # scripts/benchmarks
ROOT = SCRIPTS.parents[1]  # the checkout
RESULTS = SCRIPTS / "results"


# --------------------------------------------------------------------------------------------------------------------
# The machine.


def machine() -> dict:
    """The hardware and versions a measurement was taken with. Beside the CPU's name, its family and model (two hosts
    both named "AMD EPYC" can be different generations) and the vector instructions torch's kernels use: a training
    run's figures depend on them, not only its speed (another summation order, another trajectory from the same seed;
    scripts/research/results/sort_of_clevr_ladder.md)."""
    import transformers

    cpu = platform.processor() or platform.machine()
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    cpu = info.get("model name", cpu)
    family_model = f"{info['cpu family']}/{info['model']}" if {"cpu family", "model"} <= info.keys() else None
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "cpu_family_model": family_model,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


# --------------------------------------------------------------------------------------------------------------------
# Peak memory.


def proc_status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, ...); None where there is no such file or field."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def reuse_freed_memory() -> bool:
    """
    Make glibc keep freed memory in this process (`mallopt`: mmap threshold 32 MiB, trim threshold 1 GiB); `False`
    where the C library is not glibc. For loops timed outside the `Trainer`: torch has no caching allocator on a CPU,
    and with glibc's dynamic thresholds a step of the default model in profile_training_step.py's own loop faulted in
    its activations afresh every step (~1,300 minor faults, 107 against 90 ms a step), while the same step in
    `scripts/train.py`'s `Trainer` faulted none (the thresholds depend on what the process freed before). With this
    set, such a loop times what training pays. Process-wide and for the process's life.
    """
    import ctypes

    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # M_MMAP_THRESHOLD (-3) first: setting either ends the dynamic threshold; M_TRIM_THRESHOLD (-1). 1 = success.
    return mallopt(-3, 32 * 2**20) == 1 and mallopt(-1, 2**30) == 1


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux: `echo 5 > /proc/self/clear_refs`); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_mib() -> float:
    """This process's peak memory since it started: allocated GPU memory where there is a GPU, else RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class PeakMemory:
    """
    Growth of peak memory over the memory in use when entered: allocated memory on a GPU, RSS on CPU (the high-water
    mark reset on entry where Linux allows it; otherwise the process's lifetime peak, so use a fresh process).
    """

    def __enter__(self):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline, self.method = torch.cuda.memory_allocated(), "torch.cuda.max_memory_allocated"
        else:
            rss = proc_status_kib("VmRSS")
            reset = reset_peak_rss()
            self.method = "VmHWM (reset) - VmRSS" if reset and rss is not None else "ru_maxrss - VmRSS (no reset)"
            self.baseline = (rss or 0) * 1024
        return self

    def growth_mib(self) -> float:
        """Peak memory so far over the baseline, in MiB."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        elif self.method.startswith("VmHWM"):
            peak = proc_status_kib("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return (peak - self.baseline) / 2**20

    def __exit__(self, *exc):
        self.baseline_mib = self.baseline / 2**20


# --------------------------------------------------------------------------------------------------------------------
# Trials in fresh processes.


def offline_env(datasets_cache: str | None = None) -> dict:
    """This environment, offline, with `HF_DATASETS_CACHE` set when given (it must be set before a new interpreter
    imports datasets)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if datasets_cache:
        env["HF_DATASETS_CACHE"] = datasets_cache
    return env


def _function(target: str):
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def run_in_new_interpreter(target: str, payload: dict, datasets_cache: str | None = None) -> dict:
    """Run the trial `target` ("module:function" of this folder) on `payload` in a new Python; return its result."""
    with tempfile.TemporaryDirectory() as work:
        result_file = os.path.join(work, "result.json")
        command = [sys.executable, str(Path(__file__).resolve()), "--trial", target, json.dumps(payload), result_file]
        done = subprocess.run(command, env=offline_env(datasets_cache), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"trial {target} {payload} failed:\n{done.stderr[-4000:]}")
        with open(result_file) as f:
            return json.load(f)


def _run_trial(target: str, payload: str, result_file: str) -> None:
    with open(result_file, "w") as f:
        json.dump(_function(target)(json.loads(payload)), f)


def _serve(preload: list[str]) -> None:
    """
    The fork server of `TrialRunner`: import `preload` once, then for each line `[target, payload, result_file]` on
    stdin run the trial in a child forked for it (a fresh process: its own memory, peak RSS and torch thread pool,
    which nothing here has started) and answer `{"exit_code": N}` on stdout. Nothing here runs a torch operation or
    touches a GPU, so the children start clean.
    """
    for module in preload:
        importlib.import_module(module)
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the server or its children print goes to the log, not into the answers
    protocol.write(json.dumps({"ready": True}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        target, payload, result_file = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with open(result_file, "w") as f:
                    json.dump(_function(target)(payload), f)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        protocol.write(json.dumps({"exit_code": os.waitstatus_to_exitcode(status)}) + "\n")
        protocol.flush()


class TrialRunner:
    """
    Runs each trial in a fresh process: a child forked from a server that imported `preload` once, or with
    `fresh_interpreter` (or without `os.fork`) a new Python interpreter. `datasets_cache` is the `HF_DATASETS_CACHE`
    of every trial.
    """

    def __init__(self, work: str, datasets_cache: str, preload: list[str], fresh_interpreter: bool = False):
        self.work, self.datasets_cache, self.preload, self.server = work, datasets_cache, preload, None
        self.fork = not fresh_interpreter and hasattr(os, "fork")
        self.log_path = os.path.join(work, "server.log")

    def _log_tail(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def _answer(self, what: str) -> dict:
        answer = self.server.stdout.readline()
        if not answer:
            raise RuntimeError(f"The fork server ended during {what}:\n{self._log_tail()}")
        return json.loads(answer)

    def _start(self) -> None:
        """Start the server on first use, and wait until it is ready (its imports must not overlap a trial)."""
        self.log = open(self.log_path, "w")
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", *self.preload]
        self.server = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=offline_env(self.datasets_cache),
            text=True,
        )
        self._answer("its start")

    def run(self, target: str, payload: dict) -> dict:
        if not self.fork:
            return run_in_new_interpreter(target, payload, self.datasets_cache)
        if self.server is None:
            self._start()
        result_file = os.path.join(tempfile.mkdtemp(dir=self.work), "result.json")
        self.server.stdin.write(json.dumps([target, payload, result_file]) + "\n")
        self.server.stdin.flush()
        exit_code = self._answer(f"trial {target}")["exit_code"]
        if exit_code != 0:
            raise RuntimeError(f"trial {target} {payload} failed (exit code {exit_code}):\n{self._log_tail()}")
        with open(result_file) as f:
            result = json.load(f)
        shutil.rmtree(os.path.dirname(result_file), ignore_errors=True)
        return result

    def close(self) -> None:
        if self.server is not None:
            self.server.stdin.close()
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()
            self.log.close()
            self.server = None


# --------------------------------------------------------------------------------------------------------------------
# Summaries and reports.


def spread(values: list[float]) -> dict:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def median_range(stat: dict | None, digits: int = 0, scale: float = 1.0) -> str:
    """A `spread` (scaled) as "median (min–max)" with `digits` decimals, the median alone when min == max; "n/a" for
    None."""
    if stat is None:
        return "n/a"
    low, mid, high = (f"{stat[k] * scale:.{digits}f}" for k in ("min", "median", "max"))
    return mid if stat["min"] == stat["max"] else f"{mid} ({low}–{high})"


def check_choices(given: list[str], known: tuple[str, ...] | dict, what: str) -> None:
    """A benchmark's list argument (`what`: its name) holds only `known` values; else a ValueError naming them."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"Unknown {what} {unknown}; choose from {list(known)}.")


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A markdown table of `rows` (cells as given, str() of each) under `header`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def invocation() -> str:
    """The command that started this process, as run from the checkout's root: `python scripts/benchmarks/X.py ...`."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def write_report(output: str | Path, report: dict | list, text: str | None = None) -> None:
    """Write `report` to OUTPUT.json and, when given, `text` to OUTPUT.md (`output` without a suffix). A dict report
    gets the day and the command it was made by (`date`, `command`) where it does not say them itself."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(report, dict):
        report = {"command": invocation(), "date": datetime.date.today().isoformat(), **report}
    with open(output.with_name(output.name + ".json"), "w") as f:
        json.dump(report, f, indent=2)
    if text is not None:
        with open(output.with_name(output.name + ".md"), "w") as f:
            f.write(text.rstrip("\n") + "\n")


if __name__ == "__main__":
    # sys.path[0] is this folder, so the trials' modules import by name.
    if sys.argv[1:2] == ["--trial"] and len(sys.argv) == 5:
        _run_trial(*sys.argv[2:])
    elif sys.argv[1:2] == ["--serve"]:
        _serve(sys.argv[2:])
    else:
        sys.exit("benchmarking.py is imported by the benchmark scripts; it runs only their trials (--trial, --serve).")
