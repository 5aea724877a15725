"""Imports point down (STYLE.md): no cycle among the modules of console/ and executor/, no
module importing a layer above its own, and the console never reaching past services and
selectors into the engine. Imports are read from the source, those inside functions too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The house (executor/): each folder is one concern, and a module's layer below says which
# way its imports may point. Bottom to top; a module may import modules of its own layer or
# below, never above.
#
#   common/         redaction, messages to the workers, named faults, log context, the
#                   approval rules' condition language (CEL)
#   contract/       the tool contract (tool authors import it through `executor.tools`)
#   ledger/         the records, the only code that moves them, the chain, the reads
#   tools/          the concrete tools;   gateway/  upstream MCP servers' tools
#   policy/         authorization, approval rules' simulation, per-tool limits
#   engine/         claiming, calls, commit points, leases, progress, recovery
#   worker/         what a Celery worker runs: the tasks and the sweeper
#   services/       the writes of agents, reviewers and operators
#   notifications/  telling people an item waits
#   surfaces/       the JSON API, MCP, metrics, admin
#   desk/, drill/   the demo world and the recovery drills
#
# Package faces (`__init__.py`) hold a docstring and nothing else, except `executor.tools`,
# which hands the contract to tool authors, and `executor.engine`, the engine's entry;
# executor/models.py and executor/admin.py only hand Django what lives in
# ledger/records.py and surfaces/admin.py.
LAYERS: list[tuple[str, list[str]]] = [
    (
        "foundations",
        [
            # The agents' client: it imports nothing of the server (checked below).
            r"stepward_client(\.client)?",
            r"executor",
            r"executor\.(common|ledger|contract|policy|services|notifications|surfaces|worker)",
            r"executor\.(desk|gateway)",
            r"executor\.common\.\w+",
            r"executor\.ledger\.(states|bulk|guards)",
            r"executor\.common\.conditions",
            r"executor\.notifications\.signed_webhook",
            r"executor\.surfaces\.(http|limits)",
            r"executor\.desk\.ticketdesk",
            r"executor\.management(\.commands)?",
            r"console",
            r"console\.(settings|celery|broker|storage|http|security|serving|asgi|wsgi|cli)",
            r"console\.templatetags(\..*)?",
        ],
    ),
    # The tool contract and its vocabulary, which the records use (Effect, Idempotency…).
    ("tool contract", [r"executor\.contract\.tool", r"executor\.tools"]),
    ("records", [r"executor\.ledger\.records", r"executor\.models"]),
    (
        "ledger",
        [
            r"executor\.tools\.loader",
            r"executor\.ledger\.(transitions|seals|runs)",
            r"executor\.notifications\.triggers",
            r"executor\.surfaces\.schemas",
        ],
    ),
    (
        "reads and rules",
        [
            r"executor\.tools\.(?!loader$|builtins$)\w+",
            r"executor\.tools\.builtins",
            # The MCP gateway: upstreams' tools as tools, and this process's sessions with them.
            r"executor\.gateway\.\w+",
            r"executor\.ledger\.(chain|retention|counters|selectors|checks)",
            r"executor\.surfaces\.(metrics|waits)",
            r"executor\.policy\.(authorization|simulation|tool_limits)",
        ],
    ),
    ("progress", [r"executor\.engine\.progress"]),
    ("engine", [r"executor\.engine(\.(?!progress$|recovery$)\w+)?"]),
    ("recovery", [r"executor\.engine\.recovery"]),
    (
        "writes",
        [
            r"executor\.services\.(?!decisions$)\w+",
            r"executor\.notifications\.outbox",
            r"executor\.worker\.sweeper",
        ],
    ),
    ("decisions", [r"executor\.services\.decisions"]),
    (
        "entry points",
        [
            r"executor\.worker\.tasks",
            r"executor\.surfaces\.(api|mcp|mcp_server|admin)",
            r"executor\.(signals|admin|apps)",
            r"executor\.desk\.demo",
            r"executor\.drill(\..*)?",
            r"executor\.management\.commands\.\w+",
        ],
    ),
    ("console", [r"console\.(views|forms|urls|console_urls|metrics|signin)"]),
]

# What the console may use of the executor: the services and selectors above the engine.
CONSOLE_MAY_NOT_IMPORT = (
    "executor.engine",
    "executor.ledger.transitions",
    "executor.ledger.bulk",
    "executor.common.dispatch",
)


def layer_of(module: str) -> int:
    for rank, (_name, patterns) in enumerate(LAYERS):
        if any(re.fullmatch(pattern, module) for pattern in patterns):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__}")


def modules() -> dict[str, Path]:
    found = {}
    for package in ("console", "executor", "stepward_client"):
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
                # `from executor.ledger import records` names the submodule, not the package;
                # `from executor.ledger.records import Step` names the module.
                submodules = [f"{base}.{alias.name}" for alias in node.names]
                named = [target for target in submodules if target in known]
                targets = named if len(named) == len(submodules) else [base, *named]
            for target in targets:
                # `import executor.engine.calls` names executor.engine.calls, not the package.
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
    assert "executor.engine" in graph["executor.worker.tasks"]
    assert "executor.services.tools" in graph["executor.signals"]


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


def test_the_agents_client_imports_nothing_of_the_server() -> None:
    graph = import_graph()
    client = {name for name in modules() if name.startswith("stepward_client")}
    assert client == {"stepward_client", "stepward_client.client"}
    assert {target for name in client for target in graph.get(name, ())} <= client
    # And at run time: imported in a fresh interpreter where Django and the server's own
    # packages cannot be imported at all.
    script = (
        "import sys\n"
        "for name in ('django', 'executor', 'console', 'celery', 'psycopg'):\n"
        "    sys.modules[name] = None\n"
        "import stepward_client\n"
        "print(stepward_client.Stepward.__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Stepward"


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_cycle_finder_finds_cycles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected
