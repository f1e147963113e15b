"""Fail when the modules of a package import each other in a cycle.

Every `import` statement counts, at module level or inside a function (a lazy import still ties the two modules
together), and so does `from package import name` when `name` is a submodule. The implicit import of a module's
parent packages does not: that is how Python imports, not a choice of the code. `mm_fusion` importing the package
root from inside it (`from mm_fusion import X`, `from .. import X` reaching the root) is an edge to the root like any
other, so a module that the root imports cannot import the root back.

    python .ci/import_cycles.py mm_fusion          # prints the cycles, exit status 1 if there are any
    python .ci/import_cycles.py mm_fusion --graph  # and every edge
"""

import argparse
import ast
import sys
from pathlib import Path


def modules_of(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package (a package is its __init__.py)."""
    root = package_dir.parent
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_by(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package's modules that `name` imports explicitly, each with the line of its first import."""
    is_package = path.name == "__init__.py"
    edges: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target and target not in modules:  # `a.b.func` imported as a name: the module is `a.b`
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                add(submodule if submodule in modules else origin, node.lineno)
    return edges


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", help="the package's directory, e.g. mm_fusion")
    parser.add_argument("--graph", action="store_true", help="print every edge too")
    args = parser.parse_args()
    modules = modules_of(Path(args.package).resolve())
    graph = {name: imported_by(name, path, modules) for name, path in modules.items()}
    if args.graph:
        for name in sorted(graph):
            for target, line in sorted(graph[name].items()):
                print(f"{name} -> {target} (line {line})")
    found = cycles(graph)
    for component in found:
        members = set(component)
        print(f"import cycle among {len(component)} modules:", file=sys.stderr)
        for name in component:
            for target, line in sorted(graph[name].items()):
                if target in members:
                    print(f"  {modules[name]}:{line}: {name} -> {target}", file=sys.stderr)
    edges = sum(len(targets) for targets in graph.values())
    print(f"{args.package}: {len(modules)} modules, {edges} imports between them, {len(found)} cycles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
