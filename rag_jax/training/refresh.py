"""Which retriever serves each training step: the same one throughout, or a refreshed one.

`schedule(exp, workdir, config, start)` returns the run's retriever schedule, asked once per step
(`at(step, params)`) and once at the end (`finish(params)`), so the training loop reads the same
whichever it is:

- `Fixed`: the passage encoder is frozen (the paper's setting), the stored vectors stay valid and
  the experiment's retriever serves every step.
- `IndexRefresher`: with `config.retrieval.refresh_every = R > 0` the passage encoder trains with
  the rest (the doc vectors of the retrieved passages are recomputed inside the step, so the loss
  reaches it), and the stored vectors of the whole corpus go stale. Every R steps (at steps
  s = R, 2R, ...) it takes the passage encoder's current parameters; a background thread
  re-encodes the corpus and builds a new retriever while training continues on the previous one;
  the new one serves from step s + lag on (the trainer waits for it there if it is late). Which
  index serves a step is thus a function of the step alone, never of thread timing.

The parameters of each refresh are written to `<workdir>/index_refresh/step_<s>.msgpack`, so a
resumed run rebuilds exactly the indexes an uninterrupted run would be using at that step, and
ends bitwise identical to it. Process 0 writes them; on several hosts the workdir must be shared.
The final index (`finish`, the last passage encoder's) is saved in `<workdir>/index`, where a
restore of the run finds it instead of encoding the corpus again.
"""

import concurrent.futures
import pathlib

import flax.serialization
import jax

from rag_jax.devices import distributed, sharding
from rag_jax.retrieval import files

KEEP = 4  # refresh snapshots kept on disk (older ones cannot be needed by a resume)


class Fixed:
    """One retriever for the whole run."""

    def __init__(self, retriever):
        self.retriever = retriever
        self.refreshes = 0

    def at(self, step: int, params):
        del step, params
        return self.retriever

    def finish(self, params):
        del params
        return self.retriever

    def close(self, wait: bool = False) -> None:
        del wait


class IndexRefresher:
    """A new retriever every `every` steps while the passage encoder trains; see the module
    docstring."""

    def __init__(self, exp, workdir, every: int, lag: int):
        """Args:
        exp: the experiment (its store, passage encoder settings and first retriever).
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
        self.retriever = exp.retriever
        self.directory = pathlib.Path(workdir) / "index_refresh"
        self.template = jax.device_get(exp.params["passage_encoder"])  # structure for loading
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="index-refresh")
        self.pending: tuple[int, concurrent.futures.Future] | None = None
        self.refreshes = 0  # indexes swapped in by this process

    def _build(self, passage_params, save: bool = False):
        # This process's own devices: built in a background thread, it must not be a collective.
        local = sharding.data_mesh(jax.local_devices())
        return self.exp.build_retriever(passage_params, save=save, mesh=local)

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
            self.retriever = self._build(self._load(live[-1]))
        if pending:
            self.pending = (pending[-1], self.pool.submit(self._build, self._load(pending[-1])))

    def at(self, step: int, params):
        """The retriever of step `step`, called before its batch with the parameters it starts
        from (a refresh due at `step` starts here)."""
        if self.pending is not None and step == self.pending[0] + self.lag:
            self.retriever = self.pending[1].result()
            self.pending, self.refreshes = None, self.refreshes + 1
        if step > 0 and step % self.every == 0:
            snapshot = distributed.state_to_host(params["passage_encoder"])  # state is donated
            self._save(step, snapshot)
            self.pending = (step, self.pool.submit(self._build, snapshot))
        return self.retriever

    def finish(self, params):
        """The retriever of the final passage encoder (built now, and saved), for evaluation."""
        self.close(wait=True)
        self.retriever = self._build(
            distributed.state_to_host(params["passage_encoder"]), save=True
        )
        self.refreshes += 1
        return self.retriever

    def close(self, wait: bool = False) -> None:
        """Ends the refreshes (a run that finishes, or stops at a preemption): a refresh not yet
        started is cancelled and no other starts. One already encoding is waited for with
        `wait`; without, it runs to its end in its thread, which the interpreter joins at exit
        (a stopped run has saved its checkpoint before)."""
        self.pending = None
        self.pool.shutdown(wait=wait, cancel_futures=True)


def schedule(exp, workdir, start: int):
    """The retriever schedule of a run resuming at step `start` (see the module docstring)."""
    r = exp.config.retrieval
    if not r.refresh_every:
        return Fixed(exp.retriever)
    lag = r.refresh_lag or max(1, r.refresh_every // 2)
    refresher = IndexRefresher(exp, workdir, r.refresh_every, lag)
    refresher.resume(start)
    return refresher


def _step_of(path: pathlib.Path) -> int:
    return int(path.stem.split("_")[1])
