"""Runs `--help` of each script named on the command line in this one process (one interpreter start for all, not
one each) and prints, as JSON, each one's exit code and output: `python -m helpers.script_help SCRIPT...`."""

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path


def main(scripts: list[str]) -> None:
    results = {}
    for script in scripts:
        path = Path(script)
        stdout, stderr = io.StringIO(), io.StringIO()
        code = 0
        saved_argv, saved_path = sys.argv, list(sys.path)
        sys.argv, sys.path[:0] = [str(path), "--help"], [str(path.parent)]  # as `python SCRIPT --help` has them
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                runpy.run_path(str(path), run_name="__main__")
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except BaseException as err:  # noqa: BLE001 - reported as the script's failure
            code, stderr = 1, io.StringIO(stderr.getvalue() + f"{type(err).__name__}: {err}")
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
        results[script] = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()[-2000:]}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
