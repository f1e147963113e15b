"""Shared fixtures: tiny MMFusion configs and inputs built in code, offline, on CPU."""

import atexit
import os
import shutil
import tempfile


# Before transformers / datasets are imported: never reach for the hub, and keep remote-code modules and dataset
# caches out of the user's cache.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
for variable in ("HF_MODULES_CACHE", "HF_DATASETS_CACHE"):
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=f"mm_fusion_{variable.lower()}_")
        atexit.register(shutil.rmtree, os.environ[variable], ignore_errors=True)
# Under pytest-xdist each worker gets its share of the cores, for its own torch and (inherited) the processes its
# tests start: OpenMP threads beyond the cores spin against each other and slow every job many times over.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers.models import MMFusionModelTester  # noqa: E402
from helpers.smoke import SMOKE  # noqa: E402


@pytest.fixture
def tester() -> MMFusionModelTester:
    torch.manual_seed(0)
    return MMFusionModelTester()


@pytest.fixture(scope="session", autouse=True)
def allocator_requests():
    """`--release_freed_memory` (on with `--lora`) changes glibc's malloc for the rest of the process. In this test
    process a run's request is recorded here instead, from the first fixture on (test_launch.py checks the real
    setting in a child process)."""
    import mm_fusion.training.run

    requests = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mm_fusion.training.run, "release_freed_memory", lambda: requests.append(True) or True)
        yield requests


def pytest_collection_modifyitems(config, items):
    for item in items:
        tests = SMOKE.get(item.path.name, False)
        if item.path.parent.name == "tests" and (tests is None or (tests and item.originalname in tests)):
            item.add_marker(pytest.mark.smoke)
