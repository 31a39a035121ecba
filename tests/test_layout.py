"""The package's shape: layers, no import cycle, algorithm-blind actors and transport, and a
README that lists every module.

Layers, lowest first (DESIGN.md, "Layout"); a module may import its own layer or a lower one,
never a higher one, and the import graph (every ``import``, also those inside functions) has
no cycle. The actors and the transport never branch on the RL algorithm: what differs between
algorithms is asked of ``rl/algorithm.py``'s interface.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "digenrl"

LAYERS: dict[str, int] = {
    "digenrl": 0, "config": 0, "fileio": 0, "faults": 0, "data": 0, "clusterenv": 0,
    "core": 1, "transport": 1, "models": 1, "telemetry": 1, "devices": 1,
    "rl": 2,
    "actors": 3, "sim": 3,
    "launch": 4, "export": 4,
    "cli": 5,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The digenrl modules ``name`` imports (resolved to a module, not a symbol)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import submodule` depends on the submodule (the parent package's
            # __init__ runs first for any submodule import; that is not a design dependency)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t.startswith("digenrl") and t != name and t != "digenrl":
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else parts[0]
    assert key in LAYERS, f"{module}: not in a documented layer (tests/test_layout.py LAYERS, DESIGN.md)"
    return LAYERS[key]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
            for a, deps in sorted(graph.items()) for b in sorted(deps) if _layer(b) > _layer(a)]


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d):], d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_no_module_imports_one_from_a_higher_layer() -> None:
    bad = _upward(_graph())
    assert not bad, "\n".join(bad)


def test_the_import_graph_has_no_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(cycles)


def test_the_checks_find_a_planted_cycle_and_an_upward_import() -> None:
    planted = {"digenrl.core.a": {"digenrl.actors.b"}, "digenrl.actors.b": {"digenrl.core.a"}}
    assert _upward(planted) == ["digenrl.core.a (layer 1) imports digenrl.actors.b (layer 3)"]
    assert _cycles(planted) == ["digenrl.actors.b -> digenrl.core.a -> digenrl.actors.b"]


ALGORITHM_BLIND = ("actors", "transport")
"""Packages that dispatch through ``rl/algorithm.py`` and never test the algorithm themselves."""
_ALGORITHM_NAMES = {"grpo", "nft", "awm", "dancegrpo", "flow_grpo"}
_ALGORITHM_MESSAGES = {"Chunk", "CleanSample"}  # what differs per algorithm on the data path


def _names_algorithm(node: ast.AST) -> bool:
    """``x.algorithm``, ``algorithm``, ``x.algorithm.name`` or an algorithm's name as a literal."""
    if isinstance(node, ast.Attribute) and node.attr == "algorithm":
        return True
    if isinstance(node, ast.Name) and node.id == "algorithm":
        return True
    if isinstance(node, ast.Attribute) and node.attr == "name" and _names_algorithm(node.value):
        return True
    if isinstance(node, ast.Constant) and node.value in _ALGORITHM_NAMES:
        return True
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(_names_algorithm(e) for e in node.elts)


def _algorithm_branches(source: str, where: str) -> list[str]:
    """Where ``source`` branches on the algorithm: FORWARD_ALGORITHMS, a comparison or ``match``
    on the algorithm (or its name), or an isinstance test on the per-algorithm data messages."""
    found = []
    for node in ast.walk(ast.parse(source)):
        at = f"{where}:{getattr(node, 'lineno', '?')}"
        if "FORWARD_ALGORITHMS" in (getattr(node, "id", None), getattr(node, "attr", None),
                                    node.name if isinstance(node, ast.alias) else None):
            found.append(f"{at}: FORWARD_ALGORITHMS")
        elif isinstance(node, ast.Compare) and any(map(_names_algorithm, [node.left, *node.comparators])):
            found.append(f"{at}: compares the algorithm")
        elif isinstance(node, ast.Match) and _names_algorithm(node.subject):
            found.append(f"{at}: matches on the algorithm")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
              and {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & _ALGORITHM_MESSAGES):
            found.append(f"{at}: isinstance on {ast.unparse(node.args[1])}")
    return found


def test_actors_and_transport_never_branch_on_the_algorithm() -> None:
    found = []
    for package in ALGORITHM_BLIND:
        for path in sorted((PKG / package).rglob("*.py")):
            found += _algorithm_branches(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "dispatch through rl/algorithm.py instead:\n" + "\n".join(found)


def test_the_algorithm_scan_finds_the_branches_the_actors_once_had() -> None:
    # as generate-and-stream and the trainer's staging and consume paths were written before
    # rl/algorithm.py existed
    planted = """
from digenrl.core.plan import FORWARD_ALGORITHMS
forward = cfg.train.algorithm in FORWARD_ALGORITHMS
if isinstance(msg, CleanSample):
    pass
if not isinstance(msg, (Chunk, CleanSample, Commit)):
    pass
if self.algorithm.name == "nft":
    pass
if tc.algorithm != "grpo":
    pass
"""
    assert sorted(_algorithm_branches(planted, "old.py")) == [
        "old.py:10: compares the algorithm", "old.py:2: FORWARD_ALGORITHMS",
        "old.py:3: FORWARD_ALGORITHMS", "old.py:3: compares the algorithm",
        "old.py:4: isinstance on CleanSample", "old.py:6: isinstance on (Chunk, CleanSample, Commit)",
        "old.py:8: compares the algorithm"]
    blind = """
trained = self.algorithm.streamed_steps(owners)
if isinstance(msg, (self.algorithm.staged_type, Commit)):
    pass
"""
    assert _algorithm_branches(blind, "new.py") == []


def test_the_readme_file_tree_lists_exactly_the_package_modules() -> None:
    text = (ROOT / "README.md").read_text()
    tree = text.split("## Files", 1)[1].split("```", 2)[1]
    listed: set[str] = set()
    folder: list[str] = []
    for line in tree.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m:
            continue
        depth, token = len(m.group(1)) // 2, m.group(2)
        folder = folder[:depth]
        if token.endswith("/"):
            folder.append(token.rstrip("/"))
            continue
        if folder[:1] != ["digenrl"]:
            continue
        # a line may name several modules: "sd3.py flux.py qwenimage.py video.py   the adapters"
        for word in line.split():
            if word.endswith(".py"):
                listed.add("/".join([*folder, word]))
            elif listed and not word.endswith(".py"):
                break
    actual = {str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if p.name != "__init__.py"}
    assert sorted(actual - listed) == [], "modules missing from README's file tree"
    assert sorted(listed - actual) == [], "README lists modules that do not exist"


def _argparse_users(pkg: Path) -> list[str]:
    """Modules of ``pkg`` other than cli.py that import argparse or name ``Namespace``
    (``argparse.Namespace``, a bare ``Namespace``, or either in a string annotation)."""
    found = []
    for path in sorted(pkg.rglob("*.py")):
        rel = str(path.relative_to(pkg.parent))
        if rel == "digenrl/cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            hit = ((isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names))
                   or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse")
                   or (isinstance(node, ast.Name) and node.id == "Namespace")
                   or (isinstance(node, ast.Attribute) and node.attr == "Namespace")
                   or (isinstance(node, ast.Constant) and isinstance(node.value, str)
                       and re.search(r"\bargparse\.Namespace\b", node.value) is not None))
            if hit:
                found.append(f"{rel}:{node.lineno}")
                break
    return found


def test_the_command_line_flags_stop_at_the_cli() -> None:
    """Only digenrl/cli.py sees argparse: it parses and resolves the config once and hands the
    layers below typed options (LaunchOptions, NodeOptions, PlanOptions), never the Namespace."""
    bad = _argparse_users(PKG)
    assert not bad, "argparse below digenrl/cli.py: " + ", ".join(bad)


def test_the_flags_check_finds_a_planted_namespace(tmp_path: Path) -> None:
    pkg = tmp_path / "digenrl"
    (pkg / "sim").mkdir(parents=True)
    (pkg / "cli.py").write_text("import argparse\n")
    (pkg / "launch.py").write_text("from types import SimpleNamespace\n")
    (pkg / "sim" / "plan.py").write_text("def plan_from_args(args: 'argparse.Namespace') -> int:\n    return 0\n")
    (pkg / "node.py").write_text("from argparse import Namespace\n")
    assert _argparse_users(pkg) == ["digenrl/node.py:1", "digenrl/sim/plan.py:1"]


RESOLVERS = {"digenrl/config.py": "defines it", "digenrl/cli.py": "the command line's edge",
             "digenrl/sim/plan.py": "the planner puts one config in each mode it compares"}


def test_the_mode_is_resolved_only_at_the_edge() -> None:
    """resolve_mode runs where a config enters (the CLI), and in the planner, whose question is
    one config in several modes; the code below takes a ResolvedConfig and never resolves again."""
    assert _resolvers(PKG) == sorted(RESOLVERS)


def _resolvers(pkg: Path) -> list[str]:
    """Modules of ``pkg`` that name ``resolve_mode`` (a call, a reference or an import)."""
    def names(tree: ast.AST) -> set[str]:
        return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
                | {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names})
    return sorted(str(p.relative_to(pkg.parent)) for p in pkg.rglob("*.py")
                  if "resolve_mode" in names(ast.parse(p.read_text())))
