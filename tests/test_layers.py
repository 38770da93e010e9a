"""The package's architecture (docs/development.md): each layer imports only the layers before it
(annotation-only imports under `if TYPE_CHECKING:` included), no module imports another that
imports it back at module or function level (annotation-only imports aside), one class is named Layout, callbacks observe, and components take their own config
sections."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "bigtrain"

LAYERS = [
    ("bigtrain.errors", "bigtrain.utils"),
    ("bigtrain.config",),
    ("bigtrain.store",),
    ("bigtrain.model", "bigtrain.data"),
    ("bigtrain.precision",),
    ("bigtrain.optim",),
    ("bigtrain.checkpoint",),
    ("bigtrain.parallel",),
    ("bigtrain.monitor",),
    ("bigtrain.state",),
    ("bigtrain.parallel.replicas",),
    ("bigtrain.telemetry",),
    ("bigtrain.resilience",),
    ("bigtrain.train",),
    ("bigtrain.callbacks",),
    ("bigtrain.build", "bigtrain.resume", "bigtrain.inference"),
    ("bigtrain.runner",),
    ("bigtrain.plan",),
    ("bigtrain.cli", "bigtrain.__main__", "bigtrain"),
]


def layer_of(module: str) -> int:
    best = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[1]):
                best = (level, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def bigtrain_imports(path: Path, modules: set[str], annotations: bool = False) -> dict[str, int]:
    """{imported bigtrain module: line} of one file, at any depth, TYPE_CHECKING blocks excluded
    unless `annotations`. `from pkg import name` counts as pkg.name where that is a module, else
    as pkg."""
    tree = ast.parse(path.read_text())
    skip = set() if annotations else _type_checking_lines(tree)
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            continue
        for name in names:
            if name == "bigtrain" or name.startswith("bigtrain."):
                out.setdefault(name, node.lineno)
    return out


def import_graph(annotations: bool = False) -> dict[str, dict[str, int]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: bigtrain_imports(path, modules, annotations) for name, path in files.items()}


def test_every_import_follows_the_layer_order():
    """Annotation-only imports too: a lower layer that names a higher one's type depends on it."""
    wrong = [
        f"{src} (layer {layer_of(src)}) imports {dst} (layer {layer_of(dst)}) at line {line}"
        for src, imports in import_graph(annotations=True).items()
        for dst, line in imports.items()
        if layer_of(dst) > layer_of(src)
    ]
    assert not wrong, "\n".join(wrong)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circles():
    graph = {src: set(imports) - {src} for src, imports in import_graph().items()}
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


def test_the_checker_finds_circles_and_layer_breaks():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None
    assert layer_of("bigtrain.precision.policy") < layer_of("bigtrain.parallel.backends.base")
    assert layer_of("bigtrain.callbacks.metrics") > layer_of("bigtrain.train.loop")
    assert layer_of("bigtrain.resilience.healer") < layer_of("bigtrain.train.loop")
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("bigtrain_other.x")


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_package_says_what_it_owns():
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init} has no docstring saying what the package owns"


def test_one_class_is_named_layout_the_parallel_one():
    found = [
        f"{path.relative_to(PACKAGE.parent)}"
        for path in modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "Layout"
    ]
    assert found == ["bigtrain/parallel/layout.py"]


def config_parameters() -> list[str]:
    """Function parameters annotated with the whole `Config`."""
    found = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                for arg in args:
                    if arg.annotation is not None and ast.unparse(arg.annotation) == "Config":
                        found.append(
                            f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
                        )
    return found


def test_components_take_their_own_config_sections():
    """The whole Config only where a component truly reads several sections (the run's assembly,
    the loop, validation, the planner, the DeepSpeed config): fewer than 20 parameters."""
    found = config_parameters()
    assert 0 < len(found) < 20, "\n".join(found)


def trainer_assignments(path: Path) -> list[str]:
    """`trainer.x = ...` (or `self.trainer.x`, `trainer.x += ...`) in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and ast.unparse(sub.value) in (
                    "trainer",
                    "self.trainer",
                ):
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(target)}")
    return found


def test_no_callback_assigns_the_trainers_attributes():
    """Callbacks observe; a callback that needs the loop to stop, a start point recorded or
    profiler ranges asks through the trainer's methods."""
    found = [
        hit
        for path in sorted((PACKAGE / "callbacks").glob("*.py"))
        for hit in trainer_assignments(path)
    ]
    assert found == []


def test_the_assignment_check_finds_one(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("def on_step_end(trainer):\n    trainer.replaying = True\n")
    assert trainer_assignments(source) == ["x.py:2 trainer.replaying"]


def trainer_parameters() -> list[str]:
    """Function parameters named `trainer` outside train/ and callbacks/ (the loop and what
    observes it): everything else receives typed parts (the run's state, an event sink)."""
    found = []
    for path in modules():
        if path.relative_to(PACKAGE).parts[0] in ("train", "callbacks"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                found += [
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    for arg in args
                    if arg.arg == "trainer"
                ]
    return found


def test_nothing_outside_the_loop_takes_a_trainer():
    """Replica groups, healing, resuming and reports receive the run's state (bigtrain/state),
    an event sink and the step's outcome, never the trainer to reach into."""
    assert trainer_parameters() == []


def test_the_trainer_check_finds_a_trainer_parameter(tmp_path, monkeypatch):
    package = tmp_path / "bigtrain"
    (package / "resilience").mkdir(parents=True)
    (package / "train").mkdir()
    (package / "resilience" / "x.py").write_text("def heal(trainer, step):\n    pass\n")
    (package / "train" / "loop.py").write_text("def fit(trainer):\n    pass\n")
    monkeypatch.setitem(globals(), "PACKAGE", package)
    assert trainer_parameters() == ["bigtrain/resilience/x.py:1"]
