r"""What ScaNN's recall depends on at scale: its tree's training, the leaves searched, the build.

    python -m benchmarks.scann_tree --count 1000000 --variants generic,spherical,iterations30
    python -m benchmarks.scann_tree --count 200000 --variants generic,whole --depths 100,200,400
    python -m benchmarks.scann_tree --real bench_results/minilm_squad_train.npz --leaves 137

On the scale suite's draw (`benchmarks.scale.write_vectors`: C / 200 centres, unit float16
vectors, held-out queries drawn alike; truth from `ExactIndex`), one "sample" build per variant
(`ScannIndex.build`'s: trained on 100k vectors, the rest added in batches, rescored from the
float16 file) with sqrt(C) leaves unless the variant says otherwise, then recall@10 searching
1%, 5% and 10% of the leaves at each reordering depth. Variants:

- generic: ScaNN's default k-means (12 iterations, squared-L2 centres);
- spherical: spherical k-means (unit centres), what `ScannIndex.build` uses for unit vectors;
- iterations30: the generic tree with 30 k-means iterations;
- leaves4x: the generic tree with 4 sqrt(C) leaves, trained on 64 points a leaf;
- whole: a "whole" build (ScaNN holds float32 copies and rescores itself) of the generic tree
  (below 500k vectors every variant's build is "whole", `scann_defaults`).

With `--real`, the vectors are those `python -m benchmarks.run --suites scale` caches (MiniLM
on SQuAD train's 18,896 paragraphs and its first 1,000 questions as queries), with a tree of
`--leaves` forced on them. One JSON line per variant: build seconds and the recalls.
"""

import argparse
import json
import math
import os
import tempfile
import time

import numpy as np

from benchmarks import scale
from rag_jax.retrieval import index, scann_index

VARIANTS = {  # ScannIndex.build's arguments (leaves_factor: sqrt(C) leaves times it)
    "generic": {"spherical": False},
    "spherical": {"spherical": True},
    "iterations30": {"spherical": False, "training_iterations": 30},
    "leaves4x": {"spherical": False, "leaves_factor": 4},
    "whole": {"spherical": False, "build": "whole"},
}
FRACTIONS = (0.01, 0.05, 0.1, 0.3)


def build(vectors, variant: dict, seed: int = 0, leaves: int = 0) -> scann_index.ScannIndex:
    """`ScannIndex.build` with the variant's tree (`leaves`: 0 = sqrt(C))."""
    variant = dict(variant)
    leaves = (leaves or round(math.sqrt(len(vectors)))) * variant.pop("leaves_factor", 1)
    sample = max(100_000, 64 * leaves)
    return index.ScannIndex.build(
        vectors, num_leaves=leaves, training_sample_size=sample, seed=seed, **variant
    )


def run(
    count: int,
    variants: list[str],
    depths: list[int],
    queries: int = 512,
    real: str | None = None,
    leaves: int = 0,
) -> list[dict]:
    """`real`: an .npz of `passages` and `questions` vectors (MiniLM on SQuAD, as
    `benchmarks.scale_difficulty.minilm_squad_vectors` writes it) searched instead of the
    synthetic draw."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="rag_jax_tree_") as tmp:
        if real:
            with np.load(real) as arrays:
                vectors, q = arrays["passages"], arrays["questions"]
            count = len(vectors)
        else:
            path = os.path.join(tmp, "vectors.npy")
            q = scale.write_vectors(path, count, queries, seed=0)
            vectors = np.load(path, mmap_mode="r")
        true_ids = index.ExactIndex(vectors).search(q, 10)[1]
        for name in variants:
            start = time.perf_counter()
            ix = build(vectors, VARIANTS[name], leaves=leaves)
            seconds = time.perf_counter() - start
            leaves = ix.config["num_leaves"]
            recall = {}
            for fraction in FRACTIONS:
                searched = max(1, round(leaves * fraction))
                for depth in depths:
                    ids = ix.search(q, 10, leaves_to_search=searched, reorder=depth)[1]
                    recall[f"{fraction:g} of leaves, depth {depth}"] = round(
                        scann_index.recall_at_k(ids, true_ids), 4
                    )
            row = {
                "vectors": real or "synthetic",
                "count": count,
                "variant": name,
                "leaves": leaves,
                "spherical": ix.config.get("spherical"),
                "build": ix.config["build"],
                "build_s": round(seconds, 1),
                "recall@10": recall,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            del ix
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--variants", default="generic,spherical")
    parser.add_argument("--depths", default="100", help="reordering depths, comma-separated")
    parser.add_argument("--real", default="", help="an .npz of passages/questions vectors")
    parser.add_argument("--leaves", type=int, default=0, help="leaves (0: sqrt of the count)")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    depths = [int(d) for d in args.depths.split(",")]
    run(args.count, names, depths, real=args.real or None, leaves=args.leaves)


if __name__ == "__main__":
    main()
