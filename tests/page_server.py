"""A fork server for the manual's pages (tests/test_docs.py, tests/test_docs_frameworks.py) and the
``gradhealth`` command (tests/test_demo.py): a fresh interpreter that imports torch and the
frameworks once (gradhealth never), then forks one child per run that becomes ``python page.py``
(or ``python -m gradhealth ARGS``): ``__main__``, the page's folder first on ``sys.path``, its own
cwd, environment, stdout and stderr, exit code 1 and a traceback on an exception. Each run is still
a process of its own where gradhealth has never been imported; what it no longer pays is the
interpreter's start and its frameworks' imports (most of a page's CPU: the imports alone took 112 s
of the 173 s of CPU of tests/test_docs_frameworks.py).

What a preload could change for a page that does not import it is guarded: a module a page imports
only after it sets the environment (``os.environ["KERAS_BACKEND"] = ...`` before ``import keras``)
is not preloaded, and the child checks that no other preload imported it (torch's own imports
excepted: the page imports torch first); a preload that changes the process's state (``_world``:
multiprocessing's start method, torch's defaults) stops the server with its name (``UNSAFE`` lists
those left to their pages). The server runs in a session of its own (tests/procs.py), so it, a run
and every process a run starts go together on a timeout, a failure, Ctrl-C or the end of the tests.

Run as a script, it is the server: ``python page_server.py MODULE...``; requests on stdin (one JSON
line a run), answers on stdout (``pid N`` when the run started, ``exit CODE`` when it ended).
"""

from __future__ import annotations

import json
import os
import re
import sys

#: ``import a.b, c`` / ``from a.b import c`` at the start of a line: a module the page imports
IMPORT = re.compile(r"^(?:import\s+([\w.]+(?:\s*,\s*[\w.]+)*)|from\s+([\w.]+)\s+import\b)")


def imports(script: str) -> tuple[list[str], list[str]]:
    """The modules ``script`` imports at its top level (not gradhealth's): those imported before
    it first touches the environment (preloadable), and those after (imported by the page only)."""
    before: list[str] = []
    after: list[str] = []
    into = before
    for line in script.splitlines():
        if "environ" in line and not line.startswith((" ", "\t", "#")):
            into = after
        m = IMPORT.match(line)
        if m:
            names = [n.strip() for n in (m.group(1) or m.group(2)).split(",")]
            into.extend(n for n in names if n.split(".")[0] != "gradhealth" and n not in before + after)
    return before, after


_BASE: set[str] = set()  # (in the server: the modules loaded once torch, the first preload, was imported)


#: modules never preloaded (their pages import them themselves), and why: their import changes
#: the process for every page forked after it
UNSAFE = {"torchrl": "sets multiprocessing's start method to spawn (fastai's DataLoader workers then "
                     "re-run a page that has no __main__ guard)"}


def preloadable(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] not in UNSAFE]


def _world() -> list[tuple[str, object]]:
    """What an import may change for the whole process, that a page would then inherit."""
    import multiprocessing

    import torch

    return [("multiprocessing start method", multiprocessing.get_start_method(allow_none=True)),
            ("torch default dtype", torch.get_default_dtype()), ("grad mode", torch.is_grad_enabled()),
            ("deterministic algorithms", torch.are_deterministic_algorithms_enabled()),
            ("torch threads", torch.get_num_threads()), ("recursion limit", sys.getrecursionlimit())]


def _serve(preload: list[str]) -> None:
    import importlib

    global _BASE
    importlib.import_module(preload[0])  # (torch: what every page imports first, and what it imports)
    _BASE, before = set(sys.modules), _world()
    for name in preload[1:]:
        importlib.import_module(name)
        changed = [f"{what}: {a!r} -> {b!r}" for (what, a), (_, b) in zip(before, _world()) if a != b]
        if changed:  # (a page that does not import it would run in a world it changed)
            print(f"unsafe: importing {name} changed {changed}: add it to page_server.UNSAFE", flush=True)
            return
    assert not [m for m in sys.modules if m.split(".")[0] == "gradhealth"], "a preload imported gradhealth"
    import threading

    assert threading.active_count() == 1, "a preload started a thread: forking would be unsafe"
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _page(request)  # (never returns: the page's end is the child's exit)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


def _page(request: dict) -> None:
    """In the forked child: become ``python ARGV...`` (``script.py ARGS`` or ``-m module ARGS``) and run it."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.update(request["env"])  # (over the server's: what a framework set at its import stays)
    written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], written),
                            (2, request["stderr"], written)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # (the server's reader may hold requests it read ahead)
    early = [m for m in request["fresh"] if m in sys.modules and m not in _BASE]
    if early:
        print(f"page_server: {early} were imported before the page set its environment for them; "
              "leave them out of the preload", file=sys.stderr, flush=True)
        os._exit(3)
    argv = request["argv"]
    if argv[0] == "-m":  # (as `python -m`: the cwd first on sys.path, argv[0] the module's file)
        sys.argv = argv[1:]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    raise SystemExit(0)  # (through the interpreter's own exit: atexit handlers, flushed streams)


class Server:
    """The test side: ``run`` a page's script in a child of the server (started on first use,
    preloaded with ``preload``, in ``env``; started again after a page that timed out)."""

    def __init__(self, preload: list[str], env: dict[str, str]):
        self.preload, self.env, self._proc, self._pending = preload, env, None, b""

    def _start(self) -> None:
        import subprocess
        import tempfile

        import procs

        self._log = tempfile.TemporaryFile()  # (the server's own stderr: its imports' warnings, a failed import)
        self._context = procs.popen([sys.executable, os.path.abspath(__file__), *self.preload], env=self.env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                    cwd=os.path.dirname(__file__))
        self._proc = self._context.__enter__()
        self._pending = b""
        self._expect("ready", 600)

    def _line(self, deadline: float) -> str | None:
        import select
        import time

        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self._proc.stdout.fileno(), 4096)
            if not chunk:
                return ""
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def _expect(self, word: str, timeout: float) -> str:
        import time

        line = self._line(time.monotonic() + timeout)
        if line is None or not line.startswith(word):
            self._log.seek(0)
            log = self._log.read().decode(errors="replace")[-4000:]
            self.close()
            raise RuntimeError(f"the page server said {line!r} where {word!r} was due (None: nothing in "
                               f"{timeout} s); its stderr:\n{log}")
        return line[len(word):].strip()

    def run(self, argv: list[str], *, cwd: str, env: dict[str, str], output: str, timeout: float,
            fresh: list[str] = ()):
        """(exit code, stdout, stderr) of ``python ARGV...`` run in ``cwd``, its stdout and stderr in
        the folder ``output``; TimeoutError after ``timeout`` s."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        out, err = os.path.join(output, "stdout.txt"), os.path.join(output, "stderr.txt")
        request = {"argv": argv, "cwd": cwd, "env": env, "fresh": list(fresh), "stdout": out, "stderr": err}
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        self._proc.stdin.flush()
        self._expect("pid", 60)
        try:
            code = int(self._expect("exit", timeout))
        except RuntimeError:
            raise TimeoutError(f"python {' '.join(argv)} ran over {timeout} s:\n{_read(out)[-3000:]}\n"
                               f"{_read(err)[-6000:]}") from None
        return code, _read(out), _read(err)

    def close(self) -> None:
        """The server, its page and every process that page started: killed (tests/procs.py)."""
        if self._proc is not None:
            self._context.__exit__(None, None, None)
            self._log.close()
            self._proc = None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.path.pop(0)  # (tests/: a page run as `python page.py` does not see it)
    _serve(sys.argv[1:])
