"""The research scripts are run from their folder and import each other by module name: put scripts/research on
sys.path for their tests (each puts scripts/benchmarks, whose helpers it shares, on the path itself)."""

import sys
from pathlib import Path


RESEARCH = Path(__file__).resolve().parents[2] / "scripts" / "research"
if str(RESEARCH) not in sys.path:
    sys.path.insert(0, str(RESEARCH))
