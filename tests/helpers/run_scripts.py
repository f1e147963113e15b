"""Runs several script command lines in one interpreter (one start and one import of torch and transformers for all,
where a process each costs ~7 s on 2 cores) and prints, as JSON, each one's exit code and output.

`python -m helpers.run_scripts RUNS.json`, RUNS a list of `{"argv": [SCRIPT, ARG...], "cwd": DIR or null}` (`["-m",
MODULE, ARG...]` for `python -m MODULE`). With `"no_model": true`, a run that loads a model's weights fails: the run's
errors must come before any model is loaded. A test calls `run_in_one_child`.

Each run starts with the warning filters it would start with alone (a warning shown once per process shows in every
run); the scripts' state beyond that (loggers' levels, imported modules) carries over, as it does not for a user. What
a run prints is captured; what it logs is not (a logging handler keeps the stream it was made with): a run that trains
and logs runs in a process of its own."""

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import time
import warnings
from pathlib import Path


TESTS = Path(__file__).resolve().parents[1]


class ModelLoaded(Exception):
    pass


@contextlib.contextmanager
def no_model_loads():
    from transformers import PreTrainedModel

    def refuse(cls, *args, **kwargs):
        raise ModelLoaded(f"{cls.__name__}.from_pretrained was called")

    saved = PreTrainedModel.__dict__["from_pretrained"]
    PreTrainedModel.from_pretrained = classmethod(refuse)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = saved


def run(argv: list[str], cwd: str | None = None, no_model: bool = False) -> dict:
    """`python SCRIPT ARG...` (or `python -m MODULE ARG...`) as a user runs it, in this process: its exit code,
    stdout, stderr and seconds."""
    module = argv[1] if argv[0] == "-m" else None
    if module:
        argv = argv[1:]
    path = None if module else Path(argv[0]).resolve()
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    # as `python SCRIPT ...` has them: the script's folder first on the path
    sys.argv, sys.path[:0] = [str(path or module), *argv[1:]], [str(path.parent if path else os.getcwd())]
    started = time.monotonic()
    try:
        if cwd:
            os.chdir(cwd)
        guard = no_model_loads() if no_model else contextlib.nullcontext()
        with guard, warnings.catch_warnings(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        if isinstance(done.code, str):  # sys.exit("message"): the message on stderr, status 1
            stderr.write(done.code + "\n")
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException as err:  # noqa: BLE001 - reported as the script's failure
        code = 1
        stderr.write(f"Traceback (in helpers.run_scripts)\n{type(err).__name__}: {err}")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
    seconds = time.monotonic() - started
    return {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(), "seconds": seconds}


def run_in_one_child(runs: list[dict], work: Path, env: dict | None = None, timeout: int = 600) -> list:
    """Run `runs` (each the keyword arguments of `run`: `argv`, and `cwd`, `no_model` if wanted) in one child
    interpreter started in tests/ with `env`; each run's outcome as a `subprocess.CompletedProcess` (its argv, exit
    code, stdout and stderr; `seconds` added). `work` is a directory for the list of runs."""
    listed = Path(work) / "runs.json"
    listed.write_text(json.dumps([r | {"cwd": r.get("cwd") and str(r["cwd"])} for r in runs]))
    done = subprocess.run([sys.executable, "-m", "helpers.run_scripts", str(listed)],
                          capture_output=True, text=True, cwd=TESTS, env=env, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = []
    for r, result in zip(runs, json.loads(done.stdout.splitlines()[-1]), strict=True):
        outcome = subprocess.CompletedProcess(r["argv"], result["code"], result["stdout"], result["stderr"])
        outcome.seconds = result["seconds"]
        results.append(outcome)
    return results


def main(args: list[str]) -> None:
    runs = json.loads(Path(args[0]).read_text())
    print(json.dumps([run(**r) for r in runs]))


if __name__ == "__main__":
    main(sys.argv[1:])
