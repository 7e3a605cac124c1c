"""The package's imports run one way: config -> (data, distributed) -> kernels -> ops -> model -> (train, generation)
-> (parallel planning, conversion, RL driver) -> cli. A module may import its own layer or any layer below,
never one above, and the module graph has no cycle. Every import counts, including those inside functions.
The kernels import nothing of glm5_jax, and every module is reached from the package's entry points (not
only from tests, benchmarks or experiments)."""

from __future__ import annotations

import ast
import re
import tomllib
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


def kernel_imports_of_the_package(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} imports {target}" for module, imports in sorted(graph.items())
            if module.split(".")[0] == "pallas_kernels" for target in sorted(imports)
            if target.split(".")[0] == "glm5_jax"]


# `MODULE:FUNCTION` in a string: a module the package loads by name (`glm5 rollout --reward MODULE:FUNCTION`).
_LOADED_BY_NAME = re.compile(r"\b((?:glm5_jax|pallas_kernels)(?:\.\w+)+):\w+")


def modules_named_in_strings(path: Path, known: set[str]) -> set[str]:
    return {match for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            for match in _LOADED_BY_NAME.findall(node.value) if match in known}


def entry_points(root: Path = ROOT) -> set[str]:
    """The package itself, its command-line module and the modules of its console scripts (pyproject.toml)."""
    scripts = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {}).get("scripts", {})
    return {"glm5_jax", "glm5_jax.cli"} | {target.split(":")[0] for target in scripts.values()}


def unreached_modules(root: Path = ROOT, entries: set[str] | None = None) -> set[str]:
    """Modules that no chain of imports from the entry points reaches. Importing a.b.c runs the packages a and
    a.b first; a module a reached one names as `MODULE:FUNCTION` is loaded by name and counts as reached."""
    modules = project_modules(root)
    graph = import_graph(root)
    todo, reached = list(entry_points(root) if entries is None else entries), set()
    while todo:
        module = todo.pop()
        if module in reached or module not in modules:
            continue
        reached.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:end]) for end in range(1, len(parts)))
        todo.extend(graph[module] | modules_named_in_strings(modules[module], set(modules)))
    return set(modules) - reached


# Modules that no entry point reaches yet, each with the reason; the test fails once one is reached, so this
# list only shrinks.
NOT_YET_REACHED: dict[str, str] = {}


def test_every_module_has_a_layer_and_imports_only_downward():
    assert upward_imports(import_graph()) == []


def test_the_module_graph_has_no_cycle():
    assert find_cycle(import_graph()) is None


def test_the_kernels_import_nothing_of_glm5_jax():
    assert kernel_imports_of_the_package(import_graph()) == []


def test_every_module_is_reached_from_the_entry_points():
    """No module is only imported by tests, benchmarks or experiments (or by nothing at all)."""
    unreached = unreached_modules()
    assert sorted(unreached - set(NOT_YET_REACHED)) == []
    assert sorted(set(NOT_YET_REACHED) - unreached) == [], "reached now: remove them from NOT_YET_REACHED"
    assert "glm5_jax.cli" in entry_points(), "the console script glm5 runs glm5_jax.cli:main"


def test_the_model_layer_holds_what_the_issue_puts_there():
    """Kernels, expert parallelism and token logprobs sit with the model, below training; the kernels are
    chosen in the ops layer, between them and the model."""
    for module in ("glm5_jax.model.expert_parallel", "glm5_jax.model.token_logprobs"):
        assert layer_of(module) == [name for name, _ in LAYERS].index("model")
    assert layer_of("pallas_kernels.sparse_mla") < layer_of("glm5_jax.ops.sparse_attention")
    assert layer_of("glm5_jax.ops.sparse_attention") < layer_of("glm5_jax.model.attention")


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


def test_a_kernel_importing_the_package_is_reported(tmp_path):
    _write(tmp_path, {"glm5_jax/__init__.py": "", "glm5_jax/model/__init__.py": "", "pallas_kernels/__init__.py": "",
                      "glm5_jax/model/layers.py": "", "pallas_kernels/k.py": "from glm5_jax.model import layers\n"})
    assert kernel_imports_of_the_package(import_graph(tmp_path)) == [
        "pallas_kernels.k imports glm5_jax.model.layers"]


def test_a_module_only_tests_import_is_reported(tmp_path):
    _write(tmp_path, {"pyproject.toml": '[project.scripts]\ntool = "glm5_jax.tool:main"\n',
                      "glm5_jax/__init__.py": "", "glm5_jax/cli.py": "from glm5_jax.model import moe\n",
                      "glm5_jax/tool.py": "import pallas_kernels.k\n", "glm5_jax/model/__init__.py": "",
                      "glm5_jax/model/moe.py": "HELP = 'e.g. --reward glm5_jax.model.rewards:fn'\n",
                      "glm5_jax/model/rewards.py": "", "glm5_jax/model/orphan.py": "import glm5_jax.model.leaf\n",
                      "glm5_jax/model/leaf.py": "", "pallas_kernels/__init__.py": "", "pallas_kernels/k.py": "",
                      "pallas_kernels/unused/__init__.py": ""})
    assert entry_points(tmp_path) == {"glm5_jax", "glm5_jax.cli", "glm5_jax.tool"}
    assert unreached_modules(tmp_path) == {"glm5_jax.model.orphan", "glm5_jax.model.leaf", "pallas_kernels.unused"}


@pytest.mark.parametrize("module", ["glm5_jax.experimental_thing", "glm5_jax.configuration", "somewhere.else"])
def test_a_module_outside_every_layer_is_refused(module):
    with pytest.raises(AssertionError, match="is in no layer"):
        layer_of(module)
