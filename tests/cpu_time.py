"""The CPU a command used, its fork servers' included: ``python tests/cpu_time.py make test``.

``/usr/bin/time`` counts a command and the children it waited for. The distributed tests' ranks are
forked by multiprocessing's fork server (tests/test_distributed.py's spawn), a child of the pytest
process that nobody waits for: its CPU and its ranks' would be missed. This samples every fork
server below the command (its own and its reaped children's CPU, /proc/<pid>/stat) every 0.1 s and
adds them to the command's waited-for CPU."""

import os
import resource
import subprocess
import sys
import time


def _stat(pid: str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _below(pid: str, root: int) -> bool:
    ancestor, hops = int(_stat(pid)[1]), 0
    while ancestor > 1 and ancestor != root and hops < 64:
        ancestor, hops = int(_stat(str(ancestor))[1]), hops + 1
    return ancestor == root


def main(argv: list[str]) -> int:
    tick = os.sysconf("SC_CLK_TCK")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv)
    servers: dict[str, float] = {}
    while proc.poll() is None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"multiprocessing.forkserver" not in f.read() or not _below(pid, proc.pid):
                        continue
                servers[pid] = sum(int(x) for x in _stat(pid)[11:15]) / tick  # utime stime cutime cstime
            except (OSError, ValueError, IndexError):
                pass
        time.sleep(0.1)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    waited, forked = usage.ru_utime + usage.ru_stime, sum(servers.values())
    print(f"cpu_time: {waited + forked:.1f} s of CPU ({waited:.1f} s waited for, {forked:.1f} s in fork servers), "
          f"{time.monotonic() - t0:.1f} s wall", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
