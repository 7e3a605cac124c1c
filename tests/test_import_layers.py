"""The package's imports run one way: config -> (data, distributed) -> kernels -> ops -> model -> (train, generation)
-> (parallel planning, conversion, RL driver) -> cli. A module may import its own layer or any layer below,
never one above, and the module graph has no cycle. Every import counts, including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("glm5_jax", "pallas_kernels")

# Lowest first. A module belongs to the first prefix it matches (longest prefixes are tried first).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("config", ("glm5_jax.config", "glm5_jax.tree_paths", "glm5_jax.quiet")),
    ("data and devices", ("glm5_jax.data", "glm5_jax.distributed")),
    ("kernels", ("pallas_kernels",)),
    ("ops", ("glm5_jax.ops",)),
    ("model", ("glm5_jax.model",)),
    ("train and generation", ("glm5_jax.train", "glm5_jax.generation", "glm5_jax.checkpoint")),
    ("planning and conversion", ("glm5_jax.parallel", "glm5_jax.convert", "glm5_jax.rollout")),
    ("cli", ("glm5_jax.runner", "glm5_jax.commands", "glm5_jax.examples", "glm5_jax.cli")),
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules `path` imports (`from a.b import c` counts as a.b.c when that is a module, else a.b)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
    return {m for m in found if m.split(".")[0] in PACKAGES and m != name}


def layer_of(module: str) -> int:
    if module == "glm5_jax":  # the package root holds only its version
        return 0
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    if best is None:
        raise AssertionError(f"module {module} is in no layer of tests/test_import_layers.py: add it to LAYERS")
    return best[0]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imported_modules(path, name, set(modules)) for name, path in modules.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, imports in sorted(graph.items()):
        for target in sorted(imports):
            if layer_of(target) > layer_of(module):
                problems.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                                f"({LAYERS[layer_of(target)][0]}, a layer above)")
    return problems


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None. A package's own modules are reached through their full
    names, so `from pkg import sub` is an edge to pkg.sub, not to pkg."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_every_module_has_a_layer_and_imports_only_downward():
    assert upward_imports(import_graph()) == []


def test_the_module_graph_has_no_cycle():
    assert find_cycle(import_graph()) is None


def test_the_model_layer_holds_what_the_issue_puts_there():
    """Kernels, expert parallelism and token logprobs sit with the model, below training; the kernels are
    chosen in the ops layer, between them and the model."""
    for module in ("glm5_jax.model.expert_parallel", "glm5_jax.model.token_logprobs"):
        assert layer_of(module) == [name for name, _ in LAYERS].index("model")
    assert layer_of("pallas_kernels.sparse_mla") < layer_of("glm5_jax.ops.sparse_attention")
    assert layer_of("glm5_jax.ops.sparse_attention") < layer_of("glm5_jax.model.attention")


def test_the_kernels_import_nothing_from_the_package():
    """`pallas_kernels` stands alone: its tests and the ops layer import it, never the other way round."""
    graph = import_graph()
    assert [f"{module} imports {target}" for module, imports in sorted(graph.items())
            if module.startswith("pallas_kernels") for target in sorted(imports)
            if target.startswith("glm5_jax")] == []


def _write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_an_upward_import_is_reported(tmp_path):
    _write(tmp_path, {"glm5_jax/__init__.py": "", "glm5_jax/model/__init__.py": "",
                      "glm5_jax/train/__init__.py": "", "pallas_kernels/__init__.py": "",
                      "glm5_jax/train/step.py": "", "glm5_jax/model/layers.py": "",
                      # an import inside a function counts too
                      "glm5_jax/model/moe.py": "def f():\n    from glm5_jax.train.step import x\n"})
    problems = upward_imports(import_graph(tmp_path))
    assert problems == ["glm5_jax.model.moe (model) imports glm5_jax.train.step (train and generation, a layer above)"]


def test_a_cycle_is_reported(tmp_path):
    _write(tmp_path, {"glm5_jax/__init__.py": "", "glm5_jax/model/__init__.py": "", "pallas_kernels/__init__.py": "",
                      "glm5_jax/model/a.py": "from glm5_jax.model import b\n",
                      "glm5_jax/model/b.py": "import glm5_jax.model.a\n"})
    assert find_cycle(import_graph(tmp_path)) == ["glm5_jax.model.a", "glm5_jax.model.b", "glm5_jax.model.a"]


@pytest.mark.parametrize("module", ["glm5_jax.experimental_thing", "glm5_jax.configuration", "somewhere.else"])
def test_a_module_outside_every_layer_is_refused(module):
    with pytest.raises(AssertionError, match="is in no layer"):
        layer_of(module)
