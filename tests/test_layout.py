"""The package's folders follow the data flow: no import circles, and no import up the layers.

Every ``import``/``from ... import`` in the package counts, including those inside functions (a lazy
import is still a dependency). A module may import its own layer and the layers before it.
"""

import ast
from pathlib import Path

import qevolve

PACKAGE = Path(qevolve.__file__).parent

#: in data-flow order; each entry is a top-level module or package of qevolve
LAYERS = [
    # shared utilities with no qevolve dependency beyond each other
    ["__init__", "config", "paths", "progress", "allocator", "resident", "finite", "scalars", "seeding",
     "distributed", "atomic_io", "machine"],
    ["buffer"],           # the trajectory format every later layer reads and writes, and episode metrics
    ["environments"],     # each environment with what it declares: prompt, penalties, data files, experts
    ["data"],             # installing the data files the environments declare
    ["models", "prompting"],
    ["rollouts"],
    ["training"],         # the trainer, batching and forward passes the model stages share
    ["critic"],
    ["process_rewards"],
    ["policy"],
    ["evaluation"],
    ["evolve"],
    ["cli", "testing"],
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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


def test_every_top_level_module_has_a_layer():
    layer_of = {name for layer in LAYERS for name in layer}
    assert {_top(module) for module in import_graph()} <= layer_of


def test_no_import_circles_between_modules_or_packages():
    graph = import_graph()
    assert _cycles(graph) == []
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(_top(module), set()).update(_top(t) for t in targets if _top(t) != _top(module))
    assert _cycles(packages) == []


def test_no_import_runs_up_the_layers():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    upward = [f"{module} -> {target}" for module, targets in import_graph().items() for target in sorted(targets)
              if layer[_top(module)] < layer[_top(target)]]
    assert upward == []


def test_the_checks_find_a_circle_and_an_upward_import():
    """The checks themselves can fail: a made-up graph with both faults."""
    graph = {"qevolve.policy.a": {"qevolve.policy.b"}, "qevolve.policy.b": {"qevolve.policy.a"},
             "qevolve.buffer.c": {"qevolve.critic.d"}, "qevolve.critic.d": set()}
    assert _cycles(graph) == [["qevolve.policy.a", "qevolve.policy.b"]]
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    assert layer[_top("qevolve.buffer.c")] < layer[_top("qevolve.critic.d")]
