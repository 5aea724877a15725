"""Imports point down (STYLE.md): no cycle among the modules of console/ and executor/, no
module importing a layer above its own, and the console never reaching past services and
selectors into the engine. Imports are read from the source, those inside functions too.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top. A module may import modules of its own layer or below; never above.
LAYERS: list[tuple[str, list[str]]] = [
    (
        "foundations",
        [
            r"executor",
            r"executor\.states",
            r"executor\.bulk",
            r"executor\.faults",
            r"executor\.http",
            r"executor\.limits",
            r"executor\.client",
            r"executor\.ticketdesk",
            r"executor\.dispatch",
            r"executor\.redaction",
            r"executor\.conditions",
            r"executor\.signed_webhook",
            r"executor\.logcontext",
            r"executor\.management(\.commands)?",
            r"console",
            r"console\.(settings|celery|broker|storage|http|security|serving|asgi|wsgi|cli)",
            r"console\.templatetags(\..*)?",
        ],
    ),
    # The tool contract and its vocabulary, which the records use (Effect, Idempotency…).
    ("tool contract", [r"executor\.tools", r"executor\.tools\.base"]),
    ("records", [r"executor\.models"]),
    (
        "ledger",
        [
            r"executor\.tools\.loader",
            r"executor\.transitions",
            r"executor\.triggers",
            r"executor\.seals",
            r"executor\.runs",
            r"executor\.schemas",
        ],
    ),
    (
        "reads and rules",
        [
            r"executor\.tools\.(?!base$|loader$|builtins$)\w+",
            r"executor\.tools\.builtins",
            # The MCP gateway: upstreams' tools as tools, and this process's sessions with them.
            r"executor\.gateway(\.\w+)?",
            r"executor\.ledger",
            r"executor\.retention",
            r"executor\.counters",
            r"executor\.selectors",
            r"executor\.metrics",
            r"executor\.policy",
            r"executor\.rule_simulation",
            r"executor\.tool_limits",
            r"executor\.waits",
        ],
    ),
    ("progress", [r"executor\.progress"]),
    ("engine", [r"executor\.engine(\.\w+)?"]),
    ("recovery", [r"executor\.recovery"]),
    ("writes", [r"executor\.services(\.\w+)?", r"executor\.notify", r"executor\.sweeper"]),
    ("decisions", [r"executor\.decisions"]),
    (
        "entry points",
        [
            r"executor\.(tasks|api|signals|admin|apps|demo|mcp|mcp_server|checks)",
            r"executor\.drill(\..*)?",
            r"executor\.management\.commands\.\w+",
        ],
    ),
    ("console", [r"console\.(views|forms|urls|console_urls|metrics|signin)"]),
]

# What the console may use of the executor: the services and selectors above the engine.
CONSOLE_MAY_NOT_IMPORT = (
    "executor.engine",
    "executor.recovery",
    "executor.progress",
    "executor.transitions",
    "executor.tasks",
    "executor.sweeper",
    "executor.dispatch",
    "executor.bulk",
)


def layer_of(module: str) -> int:
    for rank, (_name, patterns) in enumerate(LAYERS):
        if any(re.fullmatch(pattern, module) for pattern in patterns):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__}")


def modules() -> dict[str, Path]:
    found = {}
    for package in ("console", "executor"):
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                # `import executor.models` names executor.models, not the package.
                if target in known and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read_from_the_source() -> None:
    graph = import_graph()
    # A lazy import inside a function counts like any other.
    assert "executor.engine" in graph["executor.tasks"]
    assert "executor.services" in graph["executor.signals"]


def test_no_import_cycle_among_console_and_executor_modules() -> None:
    assert cycles(import_graph()) == []


def test_every_module_has_a_layer() -> None:
    for module in modules():
        layer_of(module)


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = [
        f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for source, targets in import_graph().items()
        for target in targets
        if layer_of(target) > layer_of(source)
    ]
    assert upward == []


def test_the_console_uses_services_and_selectors_not_the_engine() -> None:
    reaching = [
        f"{source} imports {target}"
        for source, targets in import_graph().items()
        if source.startswith("console")
        for target in targets
        if target.startswith(CONSOLE_MAY_NOT_IMPORT)
    ]
    assert reaching == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_cycle_finder_finds_cycles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected
