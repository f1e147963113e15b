"""`.ci/lint_source.py`, the lint step for what no test of behaviour sees: it names each test the smoke set lists and
its file lacks, and each file it lists that does not exist."""

import subprocess
import sys
from pathlib import Path


LINT = Path(__file__).resolve().parents[1] / ".ci" / "lint_source.py"


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LINT), str(root)], capture_output=True, text=True)


def test_a_smoke_test_its_file_lacks_is_named(tmp_path):
    (tmp_path / "tests" / "helpers").mkdir(parents=True)
    smoke = 'SMOKE = {\n    "test_a.py": None,\n    "test_b.py": {"test_kept", "test_renamed"},\n}\n'
    (tmp_path / "tests" / "helpers" / "smoke.py").write_text(smoke)
    (tmp_path / "tests" / "test_a.py").write_text("def test_anything():\n    assert True\n")
    (tmp_path / "tests" / "test_b.py").write_text("def test_kept():\n    assert True\n")
    done = lint(tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "tests/helpers/smoke.py: names test_renamed, which tests/test_b.py does not define"
    ]
    (tmp_path / "tests" / "test_b.py").write_text(
        "def test_kept():\n    assert True\n\n\ndef test_renamed():\n    pass\n"
    )
    (tmp_path / "tests" / "test_a.py").unlink()
    done = lint(tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["tests/helpers/smoke.py: names tests/test_a.py, which does not exist"]
