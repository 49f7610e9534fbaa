"""The README's Python examples, run as written on what a user has after its first command: the
default job's bundle and its transformers export (a tiny run of the default job here), and
SmolLM2 for the causal example."""

import pathlib
import re
import shutil

import numpy as np
import pytest

from rag_jax.io import bundle, hf_llama

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _blocks(section: str) -> list[str]:
    """The ```python blocks of the README section headed `section`, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.S)


@pytest.fixture(scope="module")
def paths(tiny_trained_run, tmp_path_factory):
    """The README's paths -> the tiny run's: its workdir, and its export in transformers' format
    (what `experiments/export.py --hf` writes)."""
    workdir, _ = tiny_trained_run
    tmp = tmp_path_factory.mktemp("readme")
    shutil.copytree(workdir / "bundle", tmp / "rag_default" / "bundle")
    bundle.load(tmp / "rag_default" / "bundle").to_hf(tmp / "rag_hf")
    return {
        "/tmp/rag_edited": str(tmp / "rag_edited"),
        "/tmp/rag_hf_edited": str(tmp / "rag_hf_edited"),
        "/tmp/rag_hf": str(tmp / "rag_hf"),
        "/tmp/rag_default": str(tmp / "rag_default"),
    }


def _run(code: str, paths: dict, namespace: dict) -> dict:
    for readme_path, path in paths.items():
        code = code.replace(readme_path, path)
    exec(compile(code, "<a README.md python block>", "exec"), namespace)  # noqa: S102
    return namespace


def test_the_library_quick_start_runs_as_written(paths):
    quick, _ = _blocks("Library quick start")
    ns = _run(quick, paths, {})
    batch, n_docs = len(ns["questions"]), ns["cfg"].n_docs
    assert ns["context_input_ids"].shape[0] == batch * n_docs
    assert np.all(np.isfinite(np.asarray(ns["nll"]))) and np.asarray(ns["nll"]).shape == (batch,)
    assert np.asarray(ns["out"]).shape[0] == batch


@pytest.mark.slow  # SmolLM2 read from its GGUF file and run on the example's prompts
def test_the_causal_example_runs_as_written(paths):
    quick, causal = _blocks("Library quick start")
    try:
        hf_llama.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(reason=f"the causal example needs SmolLM2: {e}")
    ns = _run(causal, paths, {})  # on its own: it needs nothing of the quick start
    assert np.asarray(ns["causal_nll"]).shape == (len(ns["questions"]),)
    assert np.all(np.asarray(ns["causal_nll"]) > 0)


def test_the_bundle_example_runs_as_written(paths):
    (example,) = _blocks("Bundles and serving")
    ns = _run(example, paths, {})
    assert isinstance(ns["a"].answer, str) and len(ns["a"].passages) > 0
    assert "resa_nemobu:colour:answer" in ns["model"].store.ids  # the edit took
    edited, pid = ns["model"].store, "resa_nemobu:colour:answer"
    assert "orange" in edited.text(list(edited.ids).index(pid))
    original = bundle.load(pathlib.Path(paths["/tmp/rag_default"]) / "bundle").store
    ids = list(original.ids)  # the example edits a copy: the default job's bundle is as it was
    assert pid not in ids or "orange" not in original.text(ids.index(pid))
    assert (pathlib.Path(paths["/tmp/rag_hf_edited"]) / "model.safetensors").is_file()
