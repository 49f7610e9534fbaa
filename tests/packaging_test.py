"""What `pip install .` ships: every folder of the package that holds modules."""

import pathlib

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
