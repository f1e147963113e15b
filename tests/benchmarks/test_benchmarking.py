"""scripts/benchmarks/benchmarking.py: trials in new interpreters and forked children, summaries and reports."""

import datetime
import json
import os
import textwrap

import pytest
from benchmarking import TrialRunner, markdown_table, median_range, run_in_new_interpreter, spread, write_report


TRIALS = textwrap.dedent(
    """
    import os
    import sys


    def echo(payload):
        if payload.get("fail"):
            print("the trial was told to fail", file=sys.stderr)
            sys.exit(3)
        return {
            "pid": os.getpid(),
            "doubled": 2 * payload["x"],
            "datasets_cache": os.environ.get("HF_DATASETS_CACHE"),
            "offline": os.environ.get("HF_HUB_OFFLINE"),
            "preloaded": "json" in sys.modules and "trial_module" in sys.modules,
        }
    """
)


@pytest.fixture
def trial_module(tmp_path, monkeypatch):
    """A module of trials that the new interpreters and the fork server can import (through PYTHONPATH)."""
    (tmp_path / "trial_module.py").write_text(TRIALS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    return "trial_module:echo"


def test_run_in_new_interpreter(trial_module, tmp_path):
    result = run_in_new_interpreter(trial_module, {"x": 21}, datasets_cache=str(tmp_path / "cache"))
    assert result["pid"] != os.getpid() and result["doubled"] == 42
    assert result["datasets_cache"] == str(tmp_path / "cache") and result["offline"] == "1"
    with pytest.raises(RuntimeError, match="the trial was told to fail"):
        run_in_new_interpreter(trial_module, {"x": 1, "fail": True})


@pytest.mark.parametrize("fresh_interpreter", [False, True])
def test_trial_runner_gives_each_trial_its_own_process(trial_module, tmp_path, fresh_interpreter):
    work = tmp_path / "work"
    work.mkdir()
    runner = TrialRunner(str(work), str(tmp_path / "cache"), ["trial_module"], fresh_interpreter=fresh_interpreter)
    try:
        first, second = (runner.run(trial_module, {"x": x}) for x in (1, 2))
        assert (first["doubled"], second["doubled"]) == (2, 4)
        assert len({first["pid"], second["pid"], os.getpid()}) == 3
        assert first["datasets_cache"] == str(tmp_path / "cache")
        with pytest.raises(RuntimeError, match="told to fail"):
            runner.run(trial_module, {"x": 0, "fail": True})
        assert runner.run(trial_module, {"x": 5})["doubled"] == 10  # a failed trial does not end the runner
    finally:
        runner.close()
    assert runner.server is None


def test_spread_and_median_range():
    stat = spread([3.0, 1.0, 2.5])
    assert stat == {"median": 2.5, "min": 1.0, "max": 3.0}
    assert median_range(stat) == "2 (1–3)"  # rounds half to even, as format does
    assert median_range(stat, digits=1) == "2.5 (1.0–3.0)"
    assert median_range(stat, digits=0, scale=1000) == "2500 (1000–3000)"
    assert median_range(spread([4.0, 4.0])) == "4"
    assert median_range(None) == "n/a"


def test_markdown_table_and_write_report(tmp_path):
    table = markdown_table(["a", "b"], [[1, "x"], [2.5, None]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | None |"]
    write_report(tmp_path / "out" / "report", {"rows": [1, 2]}, table + "\n\n")
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    # The day and the command it was made by, unless the report says them itself.
    assert saved["rows"] == [1, 2] and saved["date"] == datetime.date.today().isoformat()
    assert saved["command"].startswith("python ") and saved.keys() == {"rows", "date", "command"}
    write_report(tmp_path / "own", {"date": "2026-01-02", "command": "mine"})
    assert json.loads((tmp_path / "own.json").read_text()) == {"date": "2026-01-02", "command": "mine"}
    assert (tmp_path / "out" / "report.md").read_text() == table + "\n"
    write_report(tmp_path / "only_json", [1])
    assert (tmp_path / "only_json.json").exists() and not (tmp_path / "only_json.md").exists()
