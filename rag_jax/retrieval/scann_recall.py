"""A ScaNN index built to a recall target: held-out queries with their exact neighbours, the
settings that reach the target on them, and the record of what was measured.

ScaNN's size-based defaults (`scann_index.scann_defaults`) do not see the data: a 1M build of
clustered vectors measured recall@10 0.936, where benchmarks/scale.py's 1M draw gives 0.993. A
build to a target measures instead, before anything is saved (`index.build_and_save`,
`experiments/build_index.py --recall`):

1. Held-out queries (`held_out`): the user's own query vectors, or a stand-in drawn from the
   corpus (`stand_in_queries`), with their exact top-k (brute force over the same vectors),
   split at random into two disjoint halves: one chooses the settings, the other confirms them.
2. Query-time settings (`tune_to_recall`): `scann_index.search_ladder`, more leaves searched and
   then deeper reordering, cheapest first. A rung is taken when its recall on the tuning half
   clears the target by two standard errors of that mean (so that the other half, drawn alike,
   seldom falls short) and its recall on the confirmation half reaches the target; that half's
   recall is the one reported. The confirmation half can only veto a rung, never pick one.
3. Build settings (`build_to_recall`), when no rung reaches the target: the index is built again
   with finer AH codes trained on more points (`build_steps`), and the ladder walked again. A
   sharded build (past `scann_shards.SHARD_ROWS`) tunes its query-time settings only: rebuilding
   21M vectors is for the user to choose.

A target out of reach raises `RecallNotReached`, naming the best recall found and its settings.
The record (`measure`'s) becomes the index's `measured_recall`, saved in its manifest. The cost
beyond the build: one exact search of the held-out queries (2,000 over 1M 768-d vectors is ~3
TFLOP, a minute or two on a few cores), a search of them per rung, and a build per build step.

Legend: Q queries, C corpus size (passages), D embedding width, k neighbours per query.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rag_jax.retrieval.scann_index import recall_per_query, search_ladder

RECALL_TARGET = 0.95  # recall@RECALL_K a ScaNN build must reach on held-out queries (0: none)
RECALL_K = 10  # the recall is of the top 10 (the README's and the benchmarks' recall@10)
# Held-out queries used, half to tune and half to confirm: at 1,000 a half the standard error
# of recall@10 near 0.95 is about 0.003 (per-query recall spreads by ~0.1).
RECALL_QUERIES = 2_000
MIN_QUERIES = 100  # fewer given queries are refused: 50 a half measure to +-0.015 at best
NOISE_SCALE = 1.0  # a stand-in query's noise, in units of the corpus' spread per dimension
_STANDARD_ERRORS = 2.0  # the tuning half's recall must clear the target by this many
_SCANN_ITERATIONS = 12  # ScaNN's k-means iterations when not given
_SETTINGS = ("build", "scoring", "num_leaves", "num_leaves_to_search", "reorder",
             "training_sample_size", "hash_type", "dimensions_per_block")  # fmt: skip


class RecallNotReached(ValueError):
    """No setting tried reached the target.

    Attributes:
      best: `measure`'s record of the best setting found (by the tuning half), or None when no
        setting found k neighbours for every query.
    """

    def __init__(self, message: str, best: dict | None):
        super().__init__(message)
        self.best = best


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """Held-out queries and their exact top-k, in two disjoint halves."""

    tune_queries: np.ndarray  # [Q1, D] float32: the half the settings are chosen on
    tune_ids: np.ndarray  # [Q1, k] int64: their exact top-k
    check_queries: np.ndarray  # [Q2, D] float32: the half the reported recall is measured on
    check_ids: np.ndarray  # [Q2, k] int64: their exact top-k
    source: str  # "given" (the user's queries) or "stand-in" (`stand_in_queries`)
    seed: int  # drew the stand-in queries, a sample of many given ones, and the split


def stand_in_queries(vectors: np.ndarray, count: int = RECALL_QUERIES, seed: int = 0):
    """[count, D] float32 queries standing in for real ones: corpus rows drawn with `seed`, each
    plus Gaussian noise of `NOISE_SCALE` times the corpus' standard deviation per dimension.

    Why these: the rows themselves would overestimate recall (each is its own nearest
    neighbour, and sits on the corpus' own clusters, which the tree was trained on); noise as
    large as the corpus' spread moves each query off its row and off the clusters' cores, as a
    question tower's vectors lie off the passages'. On clustered data drawn as
    tests/retrieval/scann_recall_test.py draws it (4,000 vectors), the recall they measured at
    the defaults' tree settings was below that of queries drawn as the corpus is (0.81 against
    0.87; the rows themselves: 0.89; over the test's builds, tuning on them chose 12-16 leaves
    where queries of the corpus' draw chose 8-12),
    so a build tuned on them errs towards searching more. They can still overestimate for
    queries that lie further from every passage than the corpus' spread (another domain, an
    encoder whose question vectors occupy another region), and underestimate for lookups of
    near-duplicates. Real question vectors (`held_out(queries=...)`) measure what a user gets.

    Args:
      vectors: [C, D] the corpus (memory-mapped is fine: `count` rows and a strided sample of
        at most 10,000 are read).
      count: queries to draw (rows drawn with replacement only when C < count).
      seed: the draw (an int or a `np.random.SeedSequence`); the same seed gives the same
        queries from the same vectors.
    """
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(len(vectors), count, replace=count > len(vectors)))  # read forward
    step = max(1, len(vectors) // 10_000)
    spread = np.asarray(vectors[::step], np.float32).std(axis=0)  # -> [D]
    noise = rng.standard_normal((count, vectors.shape[1]), dtype=np.float32)
    return np.asarray(vectors[rows], np.float32) + NOISE_SCALE * spread * noise


def held_out(
    exact,
    queries=None,
    *,
    k: int = RECALL_K,
    count: int = RECALL_QUERIES,
    seed: int = 0,
) -> HeldOut:
    """Held-out queries, their exact top-k by `exact`, split into two random halves.

    Args:
      exact: an exact index over the corpus (`index.ExactIndex`): the ground truth, and, for
        stand-in queries, the corpus they are drawn from (its `vectors`).
      queries: [Q, D] the user's query vectors (e.g. question-encoder outputs), at least
        `MIN_QUERIES`; when more than `count`, `count` of them drawn with `seed`. None: `count`
        stand-in queries (`stand_in_queries`).
      k: neighbours per query (at most C).
      count: queries used.
      seed: the stand-in draw and the split.

    Raises:
      ValueError: fewer than `MIN_QUERIES` queries given, or of another width than the corpus.
    """
    draw_seed, split_seed = np.random.SeedSequence(seed).spawn(2)
    if queries is None:
        queries, source = stand_in_queries(exact.vectors, count, draw_seed), "stand-in"
    else:
        queries, source = np.asarray(queries), "given"
        if queries.ndim != 2 or len(queries) < MIN_QUERIES:
            raise ValueError(
                f"queries of shape {queries.shape} for measuring recall: give [Q, D] with Q >= "
                f"{MIN_QUERIES} (half tunes, half confirms; fewer measure too coarsely)"
            )
        if len(queries) > count:
            rng = np.random.default_rng(draw_seed)
            queries = queries[np.sort(rng.choice(len(queries), count, replace=False))]
    true_ids = exact.search(queries, min(k, exact.count))[1]  # checks the width; -> [Q, k]
    queries = np.asarray(queries, np.float32)
    order = np.random.default_rng(split_seed).permutation(len(queries))
    tune, check = order[: len(order) // 2], order[len(order) // 2 :]
    return HeldOut(
        queries[tune], true_ids[tune], queries[check], true_ids[check], source=source, seed=seed
    )


def measure(ix, held: HeldOut, target: float, *, confirm: bool = True) -> dict | None:
    """The recall of `ix` at its own settings on `held`'s halves, as the record a build keeps.

    Returns:
      {"recall": recall@k on the confirmation half (None unless `confirm`), "k", "target",
       "queries": the confirmation half's size, "query_source": `held.source`, "seed",
       "tuning_recall", "tuning_queries", "tuning_margin": what the tuning recall must exceed
       the target by (`_STANDARD_ERRORS` standard errors), "settings": `ix.config`'s ScaNN
       settings}; None when ScaNN found fewer than k neighbours for some query.
    """
    k = held.tune_ids.shape[1]
    try:
        per_query = recall_per_query(ix.search(held.tune_queries, k)[1], held.tune_ids)  # -> [Q1]
        checked = None
        if confirm:
            checked = recall_per_query(ix.search(held.check_queries, k)[1], held.check_ids)
    except RuntimeError:  # too few points in the leaves searched (ScannIndex.search)
        return None
    margin = _STANDARD_ERRORS * float(np.std(per_query) / np.sqrt(len(per_query)))
    return {
        "recall": None if checked is None else float(np.mean(checked)),
        "k": k,
        "target": target,
        "queries": len(held.check_ids),
        "query_source": held.source,
        "seed": held.seed,
        "tuning_recall": float(np.mean(per_query)),
        "tuning_queries": len(per_query),
        "tuning_margin": margin,
        "settings": {name: ix.config[name] for name in _SETTINGS if name in ix.config},
    }


def tune_to_recall(ix, held: HeldOut, target: float, *, log=None):
    """The cheapest rung of `scann_index.search_ladder` reaching `target` (see the module
    docstring), as an index carrying its `measured_recall`.

    Args:
      ix: a `ScannIndex` or `ShardedScannIndex`; its settings are the ladder's first rung.
      held: the held-out queries.
      target: recall@k to reach, in (0, 1].
      log: called with a line per rung tried (e.g. `print`), or None.

    Raises:
      RecallNotReached: no rung reached `target`; names the best (by the tuning half).
    """
    best = best_ix = None
    for leaves, depth in search_ladder(ix.config):
        candidate = ix.with_search_settings(num_leaves_to_search=leaves, reorder=depth)
        record = measure(candidate, held, target, confirm=False)
        if record is None:
            _log(log, f"leaves {leaves}, reorder {depth}: fewer than k points in the leaves")
            continue
        cleared = record["tuning_recall"] >= target + record["tuning_margin"]
        if cleared:  # only now is the confirmation half searched
            record = measure(candidate, held, target)
        _log(log, describe(record))
        if best is None or record["tuning_recall"] > best["tuning_recall"]:
            best, best_ix = record, candidate
        if cleared and record["recall"] >= target:
            return candidate.with_measured_recall(record)
    if best is not None and best["recall"] is None:
        best = measure(best_ix, held, target) or best
    raise RecallNotReached(_out_of_reach(best, target, held), best)


def build_steps(config: dict, count: int) -> list[dict]:
    """Build settings `build_to_recall` tries, in order, after the first build's ladder missed.

    Each step rebuilds with finer asymmetric-hashing codes, whose scores choose the candidates
    rescored: 256 centres a block instead of 16 (lut256), trained on 4x the sample (capped at
    C), the tree with twice ScaNN's k-means iterations; then blocks of half the width (AH
    codes twice as long). More leaves are not among them: searched in the same proportion they
    scan as many points, and the ladder already searches up to 8x the default share. Brute-force
    scoring has nothing to tune (its scores are exact), so it gets no steps.

    Args:
      config: the first build's `ScannIndex.config`.
      count: C, the vectors indexed.
    """
    if config["scoring"] != "ah":
        return []
    finer = {"hash_type": "lut256"}
    finer["training_sample_size"] = min(count, 4 * config["training_sample_size"])
    if config["num_leaves"]:
        finer["training_iterations"] = 2 * config.get("training_iterations", _SCANN_ITERATIONS)
    steps = [finer]
    if config["dimensions_per_block"] > 1:
        steps.append(finer | {"dimensions_per_block": config["dimensions_per_block"] // 2})
    return steps


def build_to_recall(build_fn, held: HeldOut, target: float, *, log=None):
    """Builds with `build_fn` and tunes to `target`, rebuilding with `build_steps` while the
    query-time ladder falls short.

    Args:
      build_fn: `build_fn(**settings)` returns a `ScannIndex` built with these
        `ScannIndex.build` settings over the corpus (none: its defaults).
      held: the held-out queries.
      target: recall@k to reach, in (0, 1].
      log: called with a line per build and per rung tried, or None.

    Returns:
      The index at the first settings reaching `target`, carrying its `measured_recall`.

    Raises:
      RecallNotReached: no build and rung reached `target`; names the best found.
    """
    ix, best = build_fn(), None
    for settings in [{}, *build_steps(ix.config, ix.count)]:
        if settings:
            _log(log, f"rebuilding ScaNN with {settings}")
            ix = build_fn(**settings)
        try:
            return tune_to_recall(ix, held, target, log=log)
        except RecallNotReached as missed:
            if missed.best and (not best or missed.best["tuning_recall"] > best["tuning_recall"]):
                best = missed.best
        del ix  # before the next build: two searchers need not be in memory at once
    raise RecallNotReached(_out_of_reach(best, target, held), best)


def describe(record: dict) -> str:
    """One line saying what `record` (`measure`'s) measured."""
    line = (
        f"recall@{record['k']} {record['tuning_recall']:.4f} on {record['tuning_queries']} "
        f"tuning queries"
    )
    if record["recall"] is not None:
        line += f", {record['recall']:.4f} on {record['queries']} held-out ones"
    return f"{line} ({record['query_source']}) at {record['settings']}"


def _out_of_reach(best: dict | None, target: float, held: HeldOut) -> str:
    if best is None:
        return (
            f"recall@{held.tune_ids.shape[1]} {target} is out of reach: no setting tried found "
            "k neighbours for every query (leaves searched hold too few points)"
        )
    return (
        f"recall@{best['k']} {target} is out of reach; the best found: {describe(best)}. "
        "Give a lower target, or build with more leaves searched or finer codes"
    )


def _log(log, line: str) -> None:
    if log is not None:
        log(line)
