"""The benchmark scripts import each other and `benchmarking` by module name, as they do when run from their
folder: put scripts/benchmarks on sys.path for their tests."""

import sys
from pathlib import Path


BENCHMARKS = Path(__file__).resolve().parents[2] / "scripts" / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
