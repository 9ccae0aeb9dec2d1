"""The package map of DESIGN.md, checked from the source: every import of every module of
skyline/ (function-level and type-only imports included) must be an edge the map allows, the
packages must not import each other in a cycle, and the code above the engine (tools, bench,
deploy and the bench/ scripts) must not reach through the engine to the worker's objects
(`llm.engine.executor...`, `....runner...`), which only exist in the engine's process."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "skyline"

# package -> the packages it may import (besides itself). cli and skyline/__init__
# may import anything.
BELOW_ENGINE = ("worker", "sched", "cache", "model", "quant", "parallel", "ops", "config",
                "configs", "envs", "progress", "types")
ALLOWED: dict[str, set[str]] = {
    "types": set(),
    "envs": set(),
    "progress": set(),  # progress bars (tqdm) for long steps at any level
    "configs": set(),
    "config": {"types"},
    "ops": {"config", "envs", "progress", "types"},
    "quant": {"ops", "config", "envs", "progress", "types"},
    "parallel": {"ops", "config", "envs", "progress", "types"},
    "model": {"quant", "parallel", "ops", "config", "configs", "envs", "progress", "types"},
    "cache": {"config", "envs", "progress", "types"},
    "sched": {"cache", "config", "envs", "progress", "types"},
    # worker uses cache's BlockPool for a draft model's own blocks
    "worker": {"model", "quant", "parallel", "ops", "cache", "config", "configs", "envs",
               "progress", "types"},
    "engine": set(BELOW_ENGINE),
    "server": {"engine", "config", "envs", "progress", "types"},
    "router": {"server", "config", "envs", "progress", "types"},
    "tools": {"engine", "config", "configs", "envs", "progress", "types"},
    "bench": {"engine", "config", "configs", "envs", "progress", "types"},
    "deploy": {"engine", "server", "router", "config", "envs", "progress", "types"},
    # `skyline tune`: runs its workload through the engine's public API and times the kernels
    # (ops) with the bench's timing and floors; writes the user's tables through ops/tuning.py
    "tune": {"engine", "bench", "ops", "config", "envs", "types"},
}
ANYTHING = {"cli", "__init__"}
# router may use the server's protocol module only
ONLY_MODULES = {("router", "server"): {"skyline.server.protocol"}}
# Code above the engine, and the attributes that reach through it into the worker's objects
# (`llm.engine.executor.runner.model`): the engine's executor, the worker's runner.
ABOVE_ENGINE = ["skyline/tools", "skyline/bench", "skyline/deploy", "skyline/tune", "bench"]
REACH_THROUGH = ("executor", "runner")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """'skyline.engine.frontend.llm' -> 'engine'; 'skyline' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def skyline_modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported skyline module) for every import in the file, each once."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the package a relative import starts from
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "skyline":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here[: len(here) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "skyline":
                continue
            for alias in node.names:  # `from skyline import envs` imports the module envs
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if is_module(sub) else base


def edges() -> list[tuple[str, str, str, int, str]]:
    """(from package, to package, file, line, imported module) over skyline/, self-edges
    left out."""
    out = []
    for path in skyline_modules():
        src = package_of(module_name(path))
        for line, mod in sorted(set(imports(path))):
            dst = package_of(mod)
            if dst != src:
                out.append((src, dst, str(path.relative_to(ROOT)), line, mod))
    return out


def test_every_import_is_an_edge_of_the_map():
    bad = []
    for src, dst, file, line, mod in edges():
        if src in ANYTHING:
            continue
        if src not in ALLOWED:
            bad.append(f"{file}:{line}: package {src!r} is not in the map (tests/test_imports.py)")
        elif dst not in ALLOWED[src] or mod not in ONLY_MODULES.get((src, dst), {mod}):
            bad.append(f"{file}:{line}: {src} -> {dst} (import of {mod}) is not allowed; "
                       f"{src} may import {', '.join(sorted(ALLOWED[src])) or 'nothing'}")
    assert not bad, "imports against the package map of DESIGN.md:\n" + "\n".join(bad)


def test_no_package_cycle():
    where: dict[tuple[str, str], str] = {}
    graph: dict[str, set[str]] = {}
    for src, dst, file, line, _ in edges():
        graph.setdefault(src, set()).add(dst)
        where.setdefault((src, dst), f"{file}:{line}")
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                ring = path[path.index(nxt):] + [nxt]
                cycles.append(" -> ".join(ring) + " (" + ", ".join(
                    f"{a}->{b} at {where[a, b]}" for a, b in pairwise(ring)) + ")")
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "package-level import cycles:\n" + "\n".join(cycles)


def chain(node: ast.Attribute) -> list[str]:
    """`a.b.c` -> ['b', 'c'] (the attribute names, outermost last)."""
    names = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        names.append(cur.attr)
        cur = cur.value
    return names[::-1]


def test_no_reach_through_the_engine():
    bad = []
    files = [p for d in ABOVE_ENGINE for p in sorted((ROOT / d).rglob("*.py"))
             if "__pycache__" not in p.parts and "results" not in p.parts]
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        parents = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if isinstance(parents.get(id(node)), ast.Attribute):
                continue  # only the outermost attribute of a chain
            names = chain(node)
            if any(n in REACH_THROUGH for n in names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: reaches through the "
                           f"engine: .{'.'.join(names)} (ask the model with LLM.query, "
                           "worker/queries.py)")
    assert not bad, "attribute chains into the worker:\n" + "\n".join(bad)
