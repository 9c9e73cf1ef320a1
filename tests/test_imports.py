"""The packages' imports point down (trainer -> strategies -> strategies/sharding -> torch; callbacks see the Trainer,
never the engine) and no module imports another in a circle. Inside trainer/, each part (a folder) imports only the
parts below it, and never the Trainer that puts them together (docs/architecture.md draws the layers).
An import inside a function counts: a circle hidden in a function is still a circle. In strategies/ an annotation-only
import (under TYPE_CHECKING) counts too: a type named in an annotation is a concept the module depends on, and the
engine's modules are layered by concept (a lower module that needs a higher one's object names what it uses in a
Protocol of its own). In trainer/ and callbacks/ annotations name the Trainer and the module everywhere (a callback
is handed the Trainer), so there only run-time imports count."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "strategies", "callbacks")
MUST_NOT_IMPORT = {  # package prefix -> prefixes it may never import
    "strategies": ("trainer", "callbacks"),
    "strategies.sharding": ("strategies.plan", "strategies.checkpoint", "trainer", "callbacks"),
}
# The checkpoint component sits between the strategies and the engine: a save and a load go one way down, from
# its callers (the Trainer, strategy.save) through it to the owners of state, never back up.
CHECKPOINT_MAY_IMPORT = ("strategies.checkpoint", "strategies.sharding")

# trainer's parts -> what each may import of trainer outside itself (module prefixes). The Trainer (trainer.trainer,
# trainer.stages), the command line (trainer.cli, above the Trainer) and the plan stay out of every part.
TRAINER_PARTS_MAY_IMPORT = {
    "trainer.launch": (),
    "trainer.observe": (),
    "trainer.profilers": (),
    "trainer.data": ("trainer.seed",),
    "trainer.checkpoint": ("trainer.seed",),
    "trainer.evaluation": (
        "trainer.module",
        "trainer.state",
        "trainer.data",
        "trainer.loop.agreement",
    ),  # count_across_ranks: the all-reduce both loops share
    "trainer.loop": ("trainer.arguments", "trainer.seed", "trainer.data", "trainer.evaluation", "trainer.launch"),
}

# Where annotation-only imports count too (module prefixes): all of strategies/. (In trainer/ and callbacks/ the
# parts name the Trainer in annotations, as hooks receive it.)
ANNOTATIONS_COUNT_IN = ("strategies",)


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def annotations_count(module: str) -> bool:
    return any(within(module, p) for p in ANNOTATIONS_COUNT_IN)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports at run time (and in annotations, where those count)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    skip_annotations = not annotations_count(name)

    def visit(node: ast.AST) -> None:
        if skip_annotations and isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    known = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, known) for p in paths}


def test_imports_point_down():
    wrong = []
    for module, imported in import_graph().items():
        for prefix, forbidden in MUST_NOT_IMPORT.items():
            if module == prefix or module.startswith(prefix + "."):
                wrong += [
                    f"{module} imports {m}" for m in imported if any(m == f or m.startswith(f + ".") for f in forbidden)
                ]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_checkpoint_component_imports_only_itself_and_the_engine():
    wrong = [
        f"{module} imports {m}"
        for module, imported in import_graph().items()
        if within(module, "strategies.checkpoint")
        for m in imported
        if not any(within(m, allowed) for allowed in CHECKPOINT_MAY_IMPORT)
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_trainer_parts_import_only_the_parts_below_them():
    wrong = []
    for module, imported in import_graph().items():
        for part, allowed in TRAINER_PARTS_MAY_IMPORT.items():
            if within(module, part):
                wrong += [
                    f"{module} imports {m}"
                    for m in imported
                    if within(m, "trainer") and not within(m, part) and not any(within(m, a) for a in allowed)
                ]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_imports_another_in_a_circle():
    graph = import_graph()
    # a package's __init__ re-exports its modules; a module importing its own package's names through the
    # __init__ is the usual Python idiom, not a circle of concepts: only module -> module edges count
    edges = {m: {i for i in imported if not (m.startswith(i + ".") and i in graph)} for m, imported in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for other in sorted(edges[module]):
            if state.get(other) == 1:
                circles.append(stack[stack.index(other) :] + [other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_architecture_page_names_every_trainer_module_and_only_files_that_exist():
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:trainer|strategies|callbacks)/[\w/.]*)`", page))
    assert not [p for p in named if not (ROOT / p).exists()], "docs/architecture.md names paths that do not exist"
    modules = [p.relative_to(ROOT).as_posix() for p in (ROOT / "trainer").rglob("*.py") if p.name != "__init__.py"]
    folders = [p for p in named if p.endswith("/") and p.count("/") > 1]  # trainer/cli/, not trainer/ itself
    unnamed = [m for m in modules if m not in named and not any(m.startswith(f) for f in folders)]
    assert not unnamed, f"docs/architecture.md does not say where these live: {sorted(unnamed)}"
