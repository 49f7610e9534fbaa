"""Index refresh for a trainable passage encoder: re-encode and re-index in the background.

With `config.retrieval.refresh_every = R > 0` the passage encoder trains with the rest (the doc
vectors of the retrieved passages are recomputed inside the step, so the loss reaches it), and the
stored vectors of the whole corpus go stale. Every R steps (at steps s = R, 2R, ...) the trainer
hands the refresher the passage encoder's current parameters; a background thread re-encodes the
corpus and builds a new index while training continues on the previous one; the new index serves
from step s + lag on (the trainer waits for it there if it is late). Which index serves a step is
thus a function of the step alone, never of thread timing.

The parameters of each refresh are written to `<workdir>/index_refresh/step_<s>.msgpack`, so a
resumed run rebuilds exactly the indexes an uninterrupted run would be using at that step, and
ends bitwise identical to it. Process 0 writes them; on several hosts the workdir must be shared.
"""

import concurrent.futures
import pathlib

import flax.serialization
import jax

from rag_jax import experiment
from rag_jax.retrieval import files

KEEP = 4  # refresh snapshots kept on disk (older ones cannot be needed by a resume)


class IndexRefresher:
    """Owns `exp.retriever` while the passage encoder trains; see the module docstring."""

    def __init__(self, exp: experiment.Experiment, workdir, every: int, lag: int):
        """Args:
        exp: the experiment whose retriever is replaced on each refresh.
        workdir: run directory; snapshots go to `<workdir>/index_refresh`.
        every: R, steps between refreshes (>= 1).
        lag: steps between a refresh's start and the step its index first serves, in [1, R].
        """
        if every < 1:
            raise ValueError(f"config.retrieval.refresh_every must be >= 1, got {every}")
        if not 1 <= lag <= every:
            raise ValueError(
                f"config.retrieval.refresh_lag={lag} must be in [1, refresh_every={every}]"
            )
        self.exp, self.every, self.lag = exp, every, lag
        self.directory = pathlib.Path(workdir) / "index_refresh"
        self.template = jax.device_get(exp.params["passage_encoder"])  # structure for loading
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="index-refresh")
        self.pending: tuple[int, concurrent.futures.Future] | None = None
        self.refreshes = 0  # indexes swapped in by this process

    def _build(self, passage_params):
        exp, c = self.exp, self.exp.config
        vectors = experiment.encode_store(
            exp.store, exp.passage_cfg, passage_params, exp.question_tokenizer, c
        )
        index = experiment.make_index(vectors, c.retrieval.index)
        return exp.retriever.swap(index, exp.store, vectors)

    def _path(self, step: int) -> pathlib.Path:
        return self.directory / f"step_{step}.msgpack"

    def _save(self, step: int, passage_params) -> None:
        if jax.process_index() != 0:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(step)
        files.write_atomic(path, flax.serialization.to_bytes(passage_params))
        for old in sorted(self.directory.glob("step_*.msgpack"), key=_step_of)[:-KEEP]:
            old.unlink()

    def _load(self, step: int):
        path = self._path(step)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the index refreshed at step {step} cannot be rebuilt, so "
                "this run cannot resume bitwise. Resume from a later checkpoint, or delete the "
                "checkpoints to start over"
            )
        try:
            return flax.serialization.from_bytes(self.template, path.read_bytes())
        except Exception as e:  # msgpack/structure errors name neither the file nor the cause
            raise ValueError(f"{path}: corrupt index-refresh snapshot ({e})") from e

    def resume(self, step: int) -> None:
        """Restores the retrieval state an uninterrupted run has just before step `step`."""
        starts = range(self.every, step, self.every)  # refreshes started before `step`
        live = [s for s in starts if s + self.lag < step]
        pending = [s for s in starts if s + self.lag >= step]
        if live:
            self.exp.retriever = self._build(self._load(live[-1]))
        if pending:
            self.pending = (pending[-1], self.pool.submit(self._build, self._load(pending[-1])))

    def before_step(self, step: int, params) -> None:
        """Call before building step `step`'s batch, with the parameters that step starts from."""
        if self.pending is not None and step == self.pending[0] + self.lag:
            self.exp.retriever = self.pending[1].result()
            self.pending, self.refreshes = None, self.refreshes + 1
        if step > 0 and step % self.every == 0:
            snapshot = jax.device_get(params["passage_encoder"])  # a host copy: state is donated
            self._save(step, snapshot)
            self.pending = (step, self.pool.submit(self._build, snapshot))

    def finish(self, params) -> None:
        """Re-indexes with the final passage encoder (synchronously) for evaluation."""
        if self.pending is not None:
            self.pending[1].cancel()
            self.pending = None
        self.exp.retriever = self._build(jax.device_get(params["passage_encoder"]))
        self.refreshes += 1
        self.pool.shutdown(wait=True)


def _step_of(path: pathlib.Path) -> int:
    return int(path.stem.split("_")[1])
