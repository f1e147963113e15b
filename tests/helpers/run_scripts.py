"""Runs several script command lines in one interpreter (one start and one import of torch and transformers for all,
where a process each costs ~7 s on 2 cores) and prints, as JSON, each one's exit code and output.

`python -m helpers.run_scripts RUNS.json`, RUNS a list of `{"argv": [SCRIPT, ARG...], "cwd": DIR or null}` (`["-m",
MODULE, ARG...]` for `python -m MODULE`); or
`python -m helpers.run_scripts --help SCRIPT...`, each script's `--help`. With `"no_model": true`, a run that loads a
model's weights fails: the run's errors must come before any model is loaded."""

import contextlib
import io
import json
import os
import runpy
import sys
import time
from pathlib import Path


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
        with guard, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
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
    return {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()[-3000:], "seconds": seconds}


def main(args: list[str]) -> None:
    if args[:1] == ["--help"]:
        runs = [{"argv": [script, "--help"]} for script in args[1:]]
    else:
        runs = json.loads(Path(args[0]).read_text())
    print(json.dumps([run(**r) for r in runs]))


if __name__ == "__main__":
    main(sys.argv[1:])
