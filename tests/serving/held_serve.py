"""`experiments/serve.py` with its edits held at a chosen file for as long as a test wants.

Run as `python tests/serving/held_serve.py <control folder> <serve.py's flags>`. While
`<control>/hold-<name>` exists, an edit's first open for writing of a file `<name>` inside a
`.<bundle>.new.*` folder (the bundle's next version: the edit's checks are done, and the copy of
the old `<name>` has not begun) waits until `<control>/go` exists, at most `HOLD_S`. A test
then knows the copy is still to come whenever it acts on the live bundle.

Nothing here is a hook in the library: the audit hook is Python's (`sys.addaudithook`),
installed in this process only. serve.py runs as `__main__`; its restart
(`host.restart_with_host_settings`) runs this file again, hook included.
"""

import os
import pathlib
import re
import runpy
import sys
import time

SERVE = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "serve.py")
HOLD_S = 120.0
_NEW_FOLDER = re.compile(r"/\.[^/]+\.new\.[^/]+/")  # `files.swap_dir`'s temporary folder


def main() -> None:
    control = sys.argv[1]

    def hook(event, args):
        if event != "open" or len(args) < 2 or not isinstance(args[0], str | bytes):
            return
        mode, path = args[1], os.fsdecode(args[0])
        if not isinstance(mode, str) or not {"w", "x"} & set(mode) or not _NEW_FOLDER.search(path):
            return
        if not os.path.exists(os.path.join(control, f"hold-{os.path.basename(path)}")):
            return
        deadline = time.monotonic() + HOLD_S
        while not os.path.exists(os.path.join(control, "go")) and time.monotonic() < deadline:
            time.sleep(0.01)

    sys.addaudithook(hook)
    sys.argv = [SERVE, *sys.argv[2:]]
    runpy.run_path(SERVE, run_name="__main__")


if __name__ == "__main__":
    main()
