"""The research scripts are run from their folder and import each other by module name: put scripts/research on
sys.path for their tests (each puts scripts/benchmarks, whose helpers it shares, on the path itself).

Every test here is marked `research`: the default run leaves them out, `pytest -m research` (and .ci/run) runs them."""

import sys
from pathlib import Path

import pytest


HERE = Path(__file__).resolve().parent
RESEARCH = HERE.parents[1] / "scripts" / "research"
if str(RESEARCH) not in sys.path:
    sys.path.insert(0, str(RESEARCH))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.research)
