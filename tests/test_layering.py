"""The import graph of grpo/, read from the source: no cycles, and the arrows that must not exist.

Function-local imports count too: a cycle through a function body is still a knot a reader must
untie, and it is how config.py had grown into a hub."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = [  # (importer prefix, imported prefix): layers that must not know each other
    ("grpo.algorithm", "grpo.rollout"), ("grpo.algorithm", "grpo.parallel"),
    ("grpo.rollout", "grpo.train"), ("grpo.rollout", "grpo.algorithm"), ("grpo.rollout", "grpo.parallel"),
    ("grpo.parallel", "grpo.rollout"),
    ("grpo.rewards", "grpo.rollout"),
    # tasks know no rollout engine (a warm start's play is handed in: grpo/tiny/guess.py); model loaders
    # and the tiny models' builders know no task (the task is handed in: grpo/tiny/folders.py builds it);
    # scorers know no prompt source, nor models a scorer
    ("grpo.tasks", "grpo.rollout"),
    ("grpo.models", "grpo.tasks"), ("grpo.tiny.text", "grpo.tasks"), ("grpo.tiny.vlm", "grpo.tasks"),
    ("grpo.tiny.warm_start", "grpo.tasks"), ("grpo.tiny.warm_start", "grpo.rollout"),
    ("grpo.rewards", "grpo.tasks"), ("grpo.models", "grpo.rewards"),
    # strategies know no update (a sequence-parallel split is handed to the update's forward as `split`);
    # the update knows no strategy class, no rollout engine and no loop
    ("grpo.parallel", "grpo.update"), ("grpo.update", "grpo.parallel"), ("grpo.update", "grpo.rollout"),
    ("grpo.update", "grpo.train"),
]
FOLDERS = ("grpo.tasks", "grpo.rewards", "grpo.models")  # each one node in `folder_graph`


def modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "grpo").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                target = resolve(name) if name.startswith("grpo") else None
                # a package's own __init__ re-exporting its modules is not an arrow between layers
                if target and target != mod and target != "grpo" and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle's nodes, found once (Tarjan's strongly connected components)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert len(graph) >= 40, sorted(graph)  # every module of grpo/, not a handful
    assert "grpo.algorithm" in graph["grpo.train"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_forbidden_arrows():
    bad = [f"{a} -> {b}" for a, targets in import_graph().items() for b in targets
           for src, dst in FORBIDDEN if a.startswith(src) and b.startswith(dst)]
    assert bad == []


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` with each of FOLDERS one node (its modules' arrows merged): a loop between folders is a
    knot even where no two files import each other."""
    def node(m):
        return next((f for f in FOLDERS if m == f or m.startswith(f + ".")), m)

    out = {node(m): set() for m in graph}
    for a, targets in graph.items():
        for b in targets:
            if node(a) != node(b):
                out[node(a)].add(node(b))
    return out


def test_no_folder_loops():
    """tasks -> rewards -> models is the order (a task's answer checker is a reward's; a scorer loads a
    model); nothing may lead back up it, through any module, function-local imports included."""
    loops = [c for c in cycles(folder_graph(import_graph())) if set(c) & set(FOLDERS)]
    assert loops == []


def unexplained_local_imports(path: Path) -> list[str]:
    """The imports inside functions of `path` with no comment saying why they are not at the top: a
    comment on one of the import's lines, or on its own line just above, or on the import just above
    in the same run of imports (a comment above a block of imports covers the block)."""
    source = path.read_text()
    lines = source.splitlines()
    commented = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    local = []

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                local.append(child)
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    walk(ast.parse(source), False)
    explained = set()  # the first line of each explained import
    for node in sorted(local, key=lambda n: n.lineno):
        above = node.lineno - 1
        if (commented & set(range(node.lineno, node.end_lineno + 1))
                or (above in commented and lines[above - 1].lstrip().startswith("#"))
                or any(n.end_lineno == above and n.lineno in explained for n in local)):
            explained.add(node.lineno)
    return [f"{path.relative_to(ROOT)}:{n.lineno}: {lines[n.lineno - 1].strip()}"
            for n in local if n.lineno not in explained]


def test_every_function_local_import_says_why():
    """Imports sit at the top of each module; one inside a function is there for a reason (an optional or
    heavy dependency a plain import must not load, a cycle, a registry loading its chosen entry only)
    that a comment beside it or just above it names."""
    bad = [line for path in sorted((ROOT / "grpo").rglob("*.py"))
           for line in unexplained_local_imports(path)]
    assert bad == []
