"""What `pip install .` ships: every folder of the package that holds modules."""

import ast
import pathlib

import pytest
import setuptools

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_installed():
    shipped = set(setuptools.find_packages(str(ROOT), include=["rag_jax", "rag_jax.*"]))
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "rag_jax").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert folders <= shipped, sorted(folders - shipped)
    assert {
        "rag_jax.models",
        "rag_jax.retrieval",
        "rag_jax.training",
        "rag_jax.io",
        "rag_jax.run",
        "rag_jax.devices",
        "rag_jax.serving",
    } <= shipped


def _imports(path: pathlib.Path, package: str = "rag_jax") -> set[str]:
    """The `package` modules `path` imports (a `from pkg import name` of a submodule counts as
    it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(package)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (ROOT / (sub.replace(".", "/") + ".py")).is_file()
                found.add(sub if is_module else node.module)
    return found


@pytest.mark.parametrize("package", ["rag_jax", "benchmarks"])
def test_no_module_imports_one_that_imports_it_back(package):
    graph = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _imports(path, package)
    done, cycles = set(), []

    def visit(node, path):
        if node in path:
            cycles.append(path[path.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    assert not cycles, cycles[:3]
    assert len(graph) > 25  # the walk read the package


def test_modules_stay_within_the_style_guides_size():
    # docs/design.md: split a module that passes ~600 lines along a seam that explains itself.
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for folder in ("rag_jax", "benchmarks", "experiments")
        for p in (ROOT / folder).rglob("*.py")
    }
    assert len(sizes) > 80
    assert not {p: n for p, n in sizes.items() if n > 600}


# docs/design.md, "Layers": the packages lowest first ("" is the top-level modules); a module
# imports only modules of its own package or of one before it in this list.
LAYERS = ("devices", "models", "", "retrieval", "io", "run", "training", "serving")


def _package(module: str) -> str:
    """The layer of a rag_jax module: its subpackage, or "" for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (ROOT / "rag_jax" / parts[-1]).is_dir() else ""


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """The imports of a module graph that reach a package above the importer's."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if rank[_package(target)] > rank[_package(module)]
    )


def test_packages_import_only_the_layers_below_them():
    graph = {}
    for path in (ROOT / "rag_jax").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _imports(path)
    assert {_package(m) for m in graph} == set(LAYERS)  # every package has its place
    upward = _layer_violations(graph)
    assert not upward, upward
    # The check catches an import upwards, e.g. the evaluation's of the trainer's batcher when it
    # lived in `run`, and the retriever's of `run.checkpoints`.
    assert _layer_violations(
        {
            "rag_jax.run.evaluation": {"rag_jax.training.batcher"},
            "rag_jax.retrieval.retriever": {"rag_jax.run.checkpoints"},
            "rag_jax.io.answers": {"rag_jax.retrieval.store"},
        }
    ) == [
        "rag_jax.retrieval.retriever -> rag_jax.run.checkpoints",
        "rag_jax.run.evaluation -> rag_jax.training.batcher",
    ]
