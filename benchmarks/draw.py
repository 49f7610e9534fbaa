"""The scale suite's vectors: C unit-norm D-wide float16 rows around C / 200 Gaussian centres
(`benchmarks.index.clustered_vectors`' draw), written to a .npy a chunk at a time, with held-out
queries drawn as the rows after them. Shared by the scale suite, its difficulty measure and the
host-step benchmark.
"""

import numpy as np

D = 768  # width of BERT-base passage vectors (DPR)
CHUNK = 65_536  # rows generated per step


def write_vectors(path, count: int, num_queries: int, seed: int) -> np.ndarray:
    """Writes [count, D] float16 unit vectors to the .npy `path`, CHUNK rows at a time; returns
    the [num_queries, D] float32 queries, drawn as the next rows of the same draw.

    The draw is `benchmarks.index.clustered_vectors`' (count // 200 centres plus noise as large),
    streamed: the noise of one chunk at a time exists as float32.
    """
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, count // 200), D), dtype=np.float32)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(count, D))
    queries = np.empty((num_queries, D), np.float32)
    total = count + num_queries
    for start in range(0, total, CHUNK):
        rows = min(CHUNK, total - start)
        block = centres[rng.integers(len(centres), size=rows)]
        block += rng.standard_normal((rows, D), dtype=np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        take = max(0, min(rows, count - start))
        out[start : start + take] = block[:take]
        if take < rows:  # the chunk reaches past the corpus: the rest are queries
            queries[start + take - count : start + rows - count] = block[take:]
    out.flush()
    del out
    return queries
