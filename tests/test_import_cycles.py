"""`.ci/import_cycles.py`, the lint step that keeps `mm_fusion`'s imports free of cycles (.ci/run runs it on
`mm_fusion`), finds the cycles a lazy import or an import of the package root makes."""

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / ".ci" / "import_cycles.py"


def check(package: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(package)], capture_output=True, text=True)


def write(package: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_a_lazy_import_that_closes_a_loop_is_a_cycle(tmp_path):
    package = write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "sub/__init__.py": "",
            "sub/arguments.py": "def settle():\n    from .models import check  # lazy\n",
            "sub/models.py": "from .arguments import settle\n",
        },
    )
    done = check(package)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pkg.sub.arguments -> pkg.sub.models" in done.stderr
    assert "pkg.sub.models -> pkg.sub.arguments" in done.stderr
    assert "1 cycles" in done.stdout


def test_importing_the_package_root_from_a_module_it_imports_is_a_cycle(tmp_path):
    package = write(
        tmp_path / "pkg",
        {
            "__init__.py": "from .onnx_model import Model\nfrom .modeling import Head\n",
            "modeling.py": "class Head: ...\n",
            "onnx_model.py": "class Model:\n    def load(self):\n        from .export import GRAPHS\n",
            "export.py": "GRAPHS = []\n\ndef main():\n    from . import Head\n",
        },
    )
    done = check(package)
    assert done.returncode == 1
    assert "pkg.export -> pkg" in done.stderr
    # The same import from the module that defines the class is no cycle.
    (package / "export.py").write_text("GRAPHS = []\n\ndef main():\n    from .modeling import Head\n")
    assert check(package).returncode == 0
