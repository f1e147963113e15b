"""Helpers of the tests: tiny models, flags of tiny training runs, test data, and the workers that multi-process
tests launch (`launch.worker_command`), importable as `helpers.*` (tests/ is on the path of pytest and the workers)."""
