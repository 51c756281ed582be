"""Reading TensorBoard event files back, robustly: ``scan`` (the runs under a log directory),
``records`` / ``events`` (one file, streamed) and ``read_run`` (a DataFrame).

The reader is its own: it streams the TFRecord framing of each event file (a length, its CRC, the
record, the record's CRC) one record at a time, so memory stays at the largest record, whatever
the size of the log. It opens only regular files (never a FIFO or a device: opening one would
block), checks every declared length against what the file holds before reading it, keeps every
record read before a bad one, and says per run what it skipped and why.
"""

from __future__ import annotations

import math
import os
import stat
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from gradhealth.publish.metrics import PREFIX
from gradhealth.base.naming import terminal_safe

__all__ = ["EVENT_FILE", "NAMES", "Run", "scan", "records", "events", "read_run", "read_layout", "safe"]

EVENT_FILE = "events.out.tfevents"
_TRAINER = "train/"  # Hugging Face Trainer's reporters write every training key as train/<key>
NAMES = " — parameters: "  # in the sink's text of a state: the grouped description, then every name


# ----------------------------------------------------------------- finding the runs
@dataclass
class Run:
    """One run directory: its event files, and what was skipped there and why."""

    name: str
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    read: int = 0  # records read


def scan(path: str) -> tuple[dict[str, Run], list[str]]:
    """The runs under ``path`` (directories holding event files, symlinked ones followed once) and
    the problems met while listing: (runs by name, notes about what could not be looked at)."""
    runs: dict[str, Run] = {}
    notes: list[str] = []
    try:
        st = os.stat(path)
    except OSError as exc:
        raise FileNotFoundError(f"{path!r} does not exist or cannot be looked at ({exc.strerror or exc}); pass the "
                                "log directory given to the TensorBoard writer or logger") from None
    if not stat.S_ISDIR(st.st_mode):
        run = runs.setdefault(".", Run("."))
        _add_file(run, path, os.path.basename(path))
        return runs, notes
    seen: set[tuple[int, int]] = set()
    stack = [path]
    while stack:
        d = stack.pop()
        try:
            key = os.stat(d)
        except OSError as exc:
            notes.append(f"{_rel(d, path)}: cannot be looked at ({exc.strerror or type(exc).__name__})")
            continue
        if (key.st_dev, key.st_ino) in seen:
            continue  # a symlink loop, or a run linked twice
        seen.add((key.st_dev, key.st_ino))
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as exc:
            notes.append(f"{_rel(d, path)}: cannot be listed ({exc.strerror or type(exc).__name__})")
            continue
        name = _rel(d, path)
        for e in entries:
            try:
                is_dir = e.is_dir(follow_symlinks=True)
            except OSError:
                is_dir = False
            if is_dir:
                stack.append(e.path)
                if e.name.startswith(EVENT_FILE):
                    runs.setdefault(name, Run(name)).skipped.append(f"{e.name}: a directory named like an event file")
            elif e.name.startswith(EVENT_FILE):
                _add_file(runs.setdefault(name, Run(name)), e.path, e.name)
            elif e.is_symlink() and not os.path.exists(e.path):
                try:  # a dangling link to a directory, or a symlink loop
                    os.stat(e.path)
                except OSError as exc:
                    notes.append(f"{_rel(e.path, path)}: cannot be looked at ({exc.strerror or type(exc).__name__})")
    return dict(sorted(runs.items())), notes


def _rel(p: str, root: str) -> str:
    r = os.path.relpath(p, root)
    return "." if r == os.curdir else r


def _add_file(run: Run, p: str, name: str) -> None:
    try:
        mode = os.stat(p).st_mode
    except OSError as exc:
        run.skipped.append(f"{name}: cannot be opened ({exc.strerror or type(exc).__name__})")
        return
    if stat.S_ISREG(mode):
        run.files.append(p)
    else:
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        run.skipped.append(f"{name}: {kind}, not read")


# ------------------------------------------------------------------- the records
def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def _crc32c_python(data: bytes) -> int:
    c, table = 0xFFFFFFFF, _TABLE
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


try:  # the C implementation when installed (pip install google-crc32c); the same numbers
    from google_crc32c import value as _crc32c
except ImportError:  # pragma: no cover - depends on the environment
    _crc32c = _crc32c_python


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C (Castagnoli) of ``data``, as TensorBoard's reader checks it."""
    c = _crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(p: str, skipped: list[str]) -> Iterator[bytes]:
    """The records of one event file, one at a time, each checked like TensorBoard's reader (masked
    CRC-32C of the length and of the data). A record whose data fails its checksum is skipped; a bad
    header (or a cut-off file) stops the file; a note in ``skipped`` says where and why, and what
    came before is kept."""
    name = os.path.basename(p)
    try:  # non-blocking: a FIFO swapped in after the scan must not hang the reader
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        skipped.append(f"{name}: cannot be opened ({exc.strerror or type(exc).__name__})")
        return
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        skipped.append(f"{name}: not a regular file, not read")
        return
    size, pos = st.st_size, 0
    with os.fdopen(fd, "rb", buffering=1 << 16) as f:
        while True:
            try:
                head = f.read(12)
            except OSError as exc:
                skipped.append(f"{name}: read error at byte {pos} ({exc.strerror or type(exc).__name__}); the rest is not read")
                return
            if not head:
                return
            if len(head) < 12:
                skipped.append(f"{name}: a partial record at byte {pos} (cut off, or still being written): not read")
                return
            (length,) = struct.unpack("<Q", head[:8])
            if _masked_crc(head[:8]) != struct.unpack("<I", head[8:])[0]:
                skipped.append(f"{name}: corrupt record header at byte {pos}; the rest of the file is not read")
                return
            if length > size - pos - 16:
                skipped.append(f"{name}: the record at byte {pos} claims {length} bytes, more than the "
                               f"{max(0, size - pos - 16)} left in the file; the rest is not read")
                return
            data = f.read(length)
            tail = f.read(4)
            if len(data) < length or len(tail) < 4:
                skipped.append(f"{name}: a partial record at byte {pos} (cut off, or still being written): not read")
                return
            if _masked_crc(data) != struct.unpack("<I", tail)[0]:  # a flipped bit must not invent a value
                # the header's own checksum held, so its length frames the next record: skip this one only
                skipped.append(f"{name}: corrupt record data at byte {pos} (checksum mismatch): that record is skipped")
            else:
                yield data
            pos += 16 + length


def events(p: str, skipped: list[str], text: bool = True) -> Iterator[tuple[int, str, float, float, str | None]]:
    """(step, tag, value, wall_time, text) of every scalar (and text) in one event file."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event

    name = os.path.basename(p)
    for k, data in enumerate(records(p, skipped)):
        ev = Event()
        try:
            ev.ParseFromString(data)
        except DecodeError:
            skipped.append(f"{name}: record {k} is not an event (corrupt); the rest of the file is not read")
            return
        if not ev.HasField("summary"):
            continue
        for v in ev.summary.value:
            tag = v.tag[len(_TRAINER):] if v.tag.startswith(_TRAINER + PREFIX + "/") else v.tag
            which = v.WhichOneof("value")
            if which == "simple_value":
                yield ev.step, tag, float(v.simple_value), ev.wall_time, None
            elif which == "tensor":
                plugin = v.metadata.plugin_data.plugin_name
                t = v.tensor
                if plugin == "text" or tag.endswith("/text_summary"):
                    if text and t.string_val:
                        yield (ev.step, tag[: -len("/text_summary")] if tag.endswith("/text_summary") else tag,
                               math.nan, ev.wall_time, t.string_val[0].decode("utf-8", "replace"))
                elif plugin == "scalars" and (t.float_val or t.double_val):
                    yield ev.step, tag, float((t.float_val or t.double_val)[0]), ev.wall_time, None
                elif plugin == "scalars" and t.tensor_content and t.dtype in (1, 2):  # DT_FLOAT, DT_DOUBLE
                    fmt = "<f" if t.dtype == 1 else "<d"
                    yield ev.step, tag, struct.unpack(fmt, t.tensor_content[: struct.calcsize(fmt)])[0], ev.wall_time, None


def read_run(path, *, progress: bool = False, text: bool = False):
    """Every scalar in every event file under ``path``: a DataFrame (step, tag, value, wall_time,
    run). ``text=True`` adds the text events (a ``text`` column, value NaN). What was skipped and
    why is in ``frame.attrs["skipped"]`` (``{run: [notes]}``). Raises ``FileNotFoundError`` /
    ``ValueError`` with the path when nothing readable is there. Holds the whole run in memory:
    ``gradhealth report`` streams instead."""
    import pandas as pd

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"read_run: path must be a str or os.PathLike (a log directory or an event file); got "
                        f"{type(path).__name__}")
    path = os.fspath(path)
    runs, notes = scan(path)
    if not any(r.files for r in runs.values()):
        raise ValueError(f"read_run: no TensorBoard event files ({EVENT_FILE}.*) under {path!r} that can be read; was "
                         f"anything logged there?{_joined(notes + [s for r in runs.values() for s in r.skipped])}")
    rows = []
    for n, run in enumerate(runs.values(), 1):
        if progress:
            print(f"\rreading {n}/{len(runs)} runs: {safe(run.name)}", end="", file=sys.stderr, flush=True)
        for p in run.files:
            rows.extend((s, t, v, w, run.name, x) for s, t, v, w, x in events(p, run.skipped, text))
    if progress:
        print(file=sys.stderr)
    frame = pd.DataFrame(rows, columns=["step", "tag", "value", "wall_time", "run", "text"])
    if not text:
        frame = frame.drop(columns="text")
    if frame.empty:
        raise ValueError(f"read_run: the event files under {path!r} hold no scalars (a run that logged nothing, or a "
                         f"corrupt file){_joined([s for r in runs.values() for s in r.skipped])}")
    frame = frame.sort_values(["run", "tag", "step"], kind="stable").reset_index(drop=True)
    frame.attrs["skipped"] = {r.name: list(r.skipped) for r in runs.values() if r.skipped}
    return frame


def _joined(notes: list[str]) -> str:
    return (" (" + "; ".join(safe(n) for n in notes[:5]) + (" ..." if len(notes) > 5 else "") + ")") if notes else ""


def safe(text) -> str:
    """Control characters escaped (ESC, BEL, CR, newlines, C1, and the surrogate escapes of
    undecodable bytes in a run directory's name): names and texts from event files reach the
    terminal as visible escapes, never as terminal commands (the core's ``terminal_safe``, with
    newlines escaped too: one item, one line)."""
    return terminal_safe(str(text)).replace("\n", "\\n")


def read_layout(path: str) -> dict[str, list[str]]:
    """The custom-scalars layout a run wrote last (TensorBoard shows that one): chart title -> tag
    patterns, in the layout's order; {} when the run wrote none."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    latest = None
    runs, _ = scan(path)
    for run in runs.values():
        for p in run.files:
            for data in records(p, run.skipped):
                ev = Event()
                ev.ParseFromString(data)
                for v in ev.summary.value:
                    if v.tag == metadata.CONFIG_SUMMARY_TAG:
                        latest = v.tensor.string_val[0]
    if latest is None:
        return {}
    lay = layout_pb2.Layout()
    lay.ParseFromString(latest)
    return {c.title: list(c.multiline.tag) for cat in lay.category for c in cat.chart}
