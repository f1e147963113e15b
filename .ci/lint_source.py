"""Fail on what the repository's sources must not do, where no test of behaviour can see it.

- Every test that tests/helpers/smoke.py names exists in its file: .ci/run reruns the smoke set (`-m smoke`) against
  the newest transformers release, and a renamed test would drop out of it unseen.

    python .ci/lint_source.py          # the repository this script is in; one line per finding, exit status 1
    python .ci/lint_source.py ROOT     # another checkout
"""

import argparse
import ast
import sys
from pathlib import Path


def assigned_literal(path: Path, name: str):
    """The literal value assigned to `name` at the top level of `path`."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"{path}: no top-level assignment to {name}")


def defined_functions(path: Path) -> set[str]:
    return {
        node.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def smoke_set_findings(root: Path) -> list[str]:
    """The files and tests that the smoke set names and the tests folder lacks."""
    smoke = root / "tests" / "helpers" / "smoke.py"
    findings = []
    for file_name, tests in assigned_literal(smoke, "SMOKE").items():
        path = root / "tests" / file_name
        if not path.is_file():
            findings.append(f"{smoke.relative_to(root)}: names tests/{file_name}, which does not exist")
            continue
        for test in sorted(set(tests or ()) - defined_functions(path)):
            findings.append(f"{smoke.relative_to(root)}: names {test}, which tests/{file_name} does not define")
    return findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1])
    root = parser.parse_args(argv).root.resolve()
    findings = smoke_set_findings(root)
    for finding in findings:
        print(finding, file=sys.stderr)
    print(f"lint_source: {len(findings)} findings")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
