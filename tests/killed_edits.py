"""A process that runs `Bundle.edit` in children of its own and SIGKILLs each at a chosen file
operation: the real crash of `tests/io/bundle_crash_test.py`, at deterministic points.

Run as `python tests/killed_edits.py <compilation cache>`. It imports rag_jax once, prints
"ready", then reads one JSON job a line from stdin:

    {"bundle": folder, "tag": str, "adds": int, "kill_at": int | null,
     "kill_before": [event, path(s)] | null, "report": file}

and answers each with one JSON line, {"exit": the child's exit code (-9: SIGKILL)}. Each job runs
in a fork of this process (imports are most of a fresh interpreter's start; this process starts
no JAX backend, so each fork starts its own): the child loads the bundle and edits it with
`edit_of(store, tag, adds)`, counting the file operations under the bundle's parent folder from
the moment the edit starts (Python's audit events: opens, renames, links, mkdirs, chmods,
removals). With `kill_at` n, or `kill_before` (the first operation that reads so, `normalized`),
it writes that operation and its number to `report` and SIGKILLs itself before the operation
runs: none of Python's cleanup (no `finally`, no `rmtree`) runs, as in a crash. Without either
the edit finishes and `report` lists every operation, in order.

Nothing here is a hook in the library: the audit hook is Python's, installed in the child only.
"""

import json
import os
import re
import signal
import sys
import traceback

# The file operations a kill may land before (their first argument is a path).
EVENTS = frozenset(
    {
        "open",
        "os.rename",
        "os.link",
        "os.mkdir",
        "os.chmod",
        "os.remove",
        "os.rmdir",
        "shutil.rmtree",
        "tempfile.mkdtemp",
        "os.truncate",
    }
)


def edit_of(store, tag: str, adds: int) -> tuple[list, list]:
    """(upserts, deletes) of the edit `tag`: `adds` new passages, ten of the store's replaced and
    its first five deleted (any store of 15 passages or more: the ids are read from it)."""
    from rag_jax.retrieval.corpus import Passage

    ids = [store.ids[i] for i in range(15)]
    upserts = [
        Passage(f"{tag}-{i}", f"{tag} title {i}", f"{tag} passage {i} about thing {i % 7} .")
        for i in range(adds)
    ]
    upserts += [Passage(pid, f"{tag} changed", f"{tag} changed text {pid} .") for pid in ids[5:]]
    return upserts, ids[:5]


def normalized(event: str, args: tuple, root: str) -> list[str]:
    """An operation as it reads in every folder and process: [event, path(s)], the root and the
    random parts of temporary names replaced (`.bundle.new.x1y2z3w4` -> `.bundle.new.*`)."""
    out = [event]
    for arg in args[:2]:  # the path, and a rename's or link's target
        if isinstance(arg, str | bytes | os.PathLike):
            text = os.fsdecode(arg).replace(root, "<root>")
            text = re.sub(r"\.(new|old)\.[A-Za-z0-9_]{8}", r".\1.*", text)
            out.append(re.sub(r"\.tmp\d+$", ".tmp*", text))  # `write_atomic`'s, by process id
    return out


def _child(job: dict) -> None:
    from rag_jax.io import bundle

    directory = os.path.abspath(job["bundle"])
    root = os.path.dirname(directory)
    model = bundle.load(directory)
    upserts, deletes = edit_of(model.store, job["tag"], job["adds"])
    seen = []

    def hook(event, args):
        if event not in EVENTS or not args or isinstance(args[0], int):
            return
        path = os.fsdecode(args[0])
        # Relative paths are `shutil.rmtree`'s (it works below an open folder, `dir_fd`).
        if (os.path.isabs(path) and not path.startswith(root + os.sep)) or path == job["report"]:
            return
        seen.append(normalized(event, args, root))
        if len(seen) == job["kill_at"] or seen[-1] == job["kill_before"]:
            with open(job["report"], "w") as f:  # the page cache outlives the process
                json.dump({"killed_at": len(seen), "event": seen[-1]}, f)
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)  # for the life of this child only
    summary = model.edit(upserts, deletes)
    with open(job["report"], "w") as f:
        json.dump({"events": seen, "summary": summary}, f)


def main(cache: str) -> None:
    import jax

    from rag_jax.io import bundle  # noqa: F401 - imported once, here, for every child

    # Compiled once (the first child), read by the others; no backend starts in this process.
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(job)
            except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
                with open(job["report"], "w") as f:
                    json.dump({"error": traceback.format_exc()}, f)
                code = 1
            os._exit(code)  # never the parent's loop, nor its exit handlers
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
