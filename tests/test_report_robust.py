"""``gradhealth report`` under bad input: event-file fixtures for each way a log directory goes
wrong (FIFO, crafted length, directory named like an event file, corrupt run among good ones,
unreadable and symlinked directories), hostile names and texts, and bounded memory."""

import csv
import io
import json
import math
import os
import struct
import sys

import pytest

pytest.importorskip("tensorboard")

from tensorboard.compat.proto.event_pb2 import Event  # noqa: E402
from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: E402
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc_update, masked_crc32c, u32  # noqa: E402

from gradhealth.integrations.tbread import NAMES, records  # noqa: E402
import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(data: bytes) -> bytes:
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked_crc32c(head)) + data + struct.pack("<I", masked_crc32c(data))


def scalars(step: int, values: dict) -> bytes:
    return record(Event(step=step, wall_time=1.0, summary=Summary(
        value=[Summary.Value(tag=t, simple_value=v) for t, v in values.items()])).SerializeToString())


def scalars_at_every_step(values: dict):
    """``step -> scalars(step, values)``, byte for byte, at a small part of its cost: the event's bytes
    are its step's few bytes then the summary's, the same at every step, and tensorboard's CRC-32C
    (pure Python, a few seconds for 24 MiB) continued over a fixed tail is affine in the CRC it
    continues from (GF(2)), so the summary's share of each checksum is worked out once: 32 columns."""
    summary = Event(summary=Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in values.items()]))
    tail = summary.SerializeToString()
    base = crc_update(0, tail)
    columns = [crc_update(1 << i, tail) ^ base for i in range(32)]

    def at(step: int) -> bytes:
        head = Event(step=step, wall_time=1.0).SerializeToString()
        start, x = crc_update(0, head), base  # x: crc_update(start, tail), one column per bit of start
        for bit, column in enumerate(columns):
            if start >> bit & 1:
                x ^= column
        length = struct.pack("<Q", len(head) + len(tail))
        return (length + struct.pack("<I", masked_crc32c(length)) + head + tail
                + struct.pack("<I", u32(((x >> 15) | u32(x << 17)) + 0xA282EAD8)))

    return at


def text(step: int, tag: str, message: str) -> bytes:
    from tensorboard.compat.proto.tensor_pb2 import TensorProto

    v = Summary.Value(tag=tag + "/text_summary", tensor=TensorProto(dtype=7, string_val=[message.encode()]))
    v.metadata.plugin_data.plugin_name = "text"
    return record(Event(step=step, wall_time=1.0, summary=Summary(value=[v])).SerializeToString())


def problem_run(directory, name="events.out.tfevents.1.host", steps=4, module="head"):
    """A run with a parameter left out of the optimizer from step 1 on, as the sink writes it."""
    os.makedirs(directory, exist_ok=True)
    data = b""
    for s in range(steps):
        bad = s >= 1
        data += scalars(s, {"gradhealth/grad_norm/total": 1.0, f"gradhealth/grad_norm/{module}": 0.5,
                            "gradhealth/status/OK": 2.0 - bad, "gradhealth/status/NOT_IN_OPTIMIZER": float(bad),
                            "gradhealth/tolerated": 0.0})
        if s == 1:
            data += text(s, "gradhealth/findings_text",
                         f"**NOT_IN_OPTIMIZER** (error, step 1): {module}.weight{NAMES}{module}.weight")
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def report(*args, timeout=60):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return procs.run([sys.executable, "-m", "gradhealth", "report", *map(str, args)], capture_output=True,
                     text=True, timeout=timeout, env=env)


def test_a_fifo_named_like_an_event_file_is_skipped_not_waited_on(tmp_path):
    problem_run(tmp_path / "run")
    os.mkfifo(tmp_path / "run" / "events.out.tfevents.2.fifo")
    res = report(tmp_path)  # the timeout fails the test if the reader blocks on the FIFO
    assert res.returncode == 0, res.stderr
    assert "NOT_IN_OPTIMIZER: head.weight NOT_IN_OPTIMIZER from step 1 on (3 checks)" in res.stdout
    assert "(skipped events.out.tfevents.2.fifo: a FIFO, not read)" in res.stdout
    skipped = []
    assert list(records(str(tmp_path / "run" / "events.out.tfevents.2.fifo"), skipped)) == [] and skipped


def test_a_crafted_length_after_valid_data_keeps_the_valid_prefix(tmp_path):
    path = problem_run(tmp_path)
    head = struct.pack("<Q", 2**62)
    with open(path, "ab") as f:
        f.write(head + struct.pack("<I", masked_crc32c(head)) + b"\0" * 64)
    res = report(tmp_path, "--format", "json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert any(r["kind"] == "NOT_IN_OPTIMIZER" and r["step"] == 1 for r in rows)
    [skip] = [r for r in rows if r["kind"] == "SKIPPED"]
    assert f"claims {2**62} bytes" in skip["detail"] and "the rest is not read" in skip["detail"]


def test_a_directory_named_like_an_event_file_does_not_hide_the_good_file(tmp_path):
    problem_run(tmp_path)
    os.mkdir(tmp_path / "events.out.tfevents.9.dir")
    res = report(tmp_path)
    assert res.returncode == 0, res.stderr
    assert "NOT_IN_OPTIMIZER" in res.stdout and "a directory named like an event file" in res.stdout


def test_one_corrupt_run_among_good_ones_is_listed_with_its_reason(tmp_path):
    problem_run(tmp_path / "a")
    problem_run(tmp_path / "c", module="tail")
    os.mkdir(tmp_path / "b")
    (tmp_path / "b" / "events.out.tfevents.1.host").write_bytes(b"\x00garbage that is not a record" * 3)
    res = report(tmp_path)
    assert res.returncode == 0, res.stderr
    assert "2 runs read" in res.stdout and "head.weight" in res.stdout and "tail.weight" in res.stdout
    assert "not read (1 place):" in res.stdout
    assert "  b: events.out.tfevents.1.host: corrupt record header at byte 0" in res.stdout
    # nothing readable at all: exit 2, and the reason
    (tmp_path / "a" / "events.out.tfevents.1.host").write_bytes(b"\x01" * 40)
    (tmp_path / "c" / "events.out.tfevents.1.host").write_bytes(b"")
    res = report(tmp_path)
    assert res.returncode == 2 and "nothing readable" in res.stderr and "Traceback" not in res.stderr


def test_unreadable_and_symlinked_directories(tmp_path):
    logs = tmp_path / "logs"
    problem_run(logs / "plain")
    elsewhere = problem_run(tmp_path / "elsewhere" / "run", module="linked")
    os.symlink(os.path.dirname(elsewhere), logs / "linked_run")  # a run directory that is a symlink
    os.symlink(logs / "loop", logs / "loop")  # a directory that cannot be looked at (ELOOP)
    locked = logs / "locked"
    problem_run(locked, module="hidden")
    os.chmod(locked, 0)
    try:
        res = report(logs)
        can_bypass = os.access(locked, os.R_OK)  # root reads it anyway
    finally:
        os.chmod(locked, 0o755)
    assert res.returncode == 0, res.stderr
    assert "linked_run: 1 finding" in res.stdout and "linked.weight" in res.stdout  # followed, not left out
    assert "loop: cannot be looked at" in res.stdout
    if not can_bypass:
        assert "locked: cannot be listed (Permission denied)" in res.stdout


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_control_characters_are_escaped_and_csv_cells_neutralised(tmp_path):
    evil_run = "run\x1b[31m\x07"
    problem_run(tmp_path / evil_run, module="=cmd|' /C calc'!A0")
    with open(tmp_path / evil_run / "events.out.tfevents.1.host", "ab") as f:
        f.write(scalars(5, {"gradhealth/grad_norm/total": math.nan, "gradhealth/grad_norm/\x1b]0;pwned\x07mod": math.nan,
                            "gradhealth/tolerated": 0.0}))
        f.write(text(5, "gradhealth/findings_text", "**STALE_GRAD** (error, step 5): +SUM(1,2) \x1b[2J cleared"))
        f.write(scalars(5, {"gradhealth/findings/STALE_GRAD": 1.0}))
    res = report(tmp_path)
    assert res.returncode == 0, res.stderr
    for raw in ("\x1b", "\x07"):
        assert raw not in res.stdout
    assert "run\\x1b[31m\\x07" in res.stdout and "\\x1b]0;pwned\\x07mod" in res.stdout
    out = report(tmp_path, "--format", "csv").stdout
    cells = [c for row in csv.reader(io.StringIO(out)) for c in row]
    assert not [c for c in cells if c[:1] in ("=", "+", "-", "@")]
    assert "'=cmd|' /C calc'!A0.weight" in cells
    # JSON stays exact: the names round-trip as they were written
    rows = json.loads(report(tmp_path, "--format", "json").stdout)
    assert {r["run"] for r in rows} == {evil_run}
    [nan] = [r for r in rows if r["kind"] == "NON_FINITE_GRAD"]
    assert nan["names"] == ["\x1b]0;pwned\x07mod"]


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_csv_and_text_escape_esc_c1_and_undecodable_run_names(tmp_path):
    # a run directory whose name holds a raw C1 byte (0x9B, CSI): undecodable in UTF-8, so Python
    # sees it as a surrogate escape
    raw = os.fsencode(str(tmp_path)) + b"/run\x9b2J"
    problem_run(os.fsdecode(raw), module="mod\x1b]0;x\x07")
    assert any("\udc9b" in d for d in os.listdir(tmp_path))  # the premise: an undecodable name
    out = report(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "\x9b" not in out.stdout and "\udc9b" not in out.stdout and "\x1b" not in out.stdout
    assert "run\\udc9b2J" in out.stdout
    csv_out = report(tmp_path, "--format", "csv").stdout
    assert "\x1b" not in csv_out and "\x07" not in csv_out and "\udc9b" not in csv_out
    assert "mod\\x1b]0;x\\x07" in csv_out


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_tensorboard_text_keeps_exact_names_and_the_report_escapes_them_for_terminals_only(tmp_path, one_thread):
    import torch
    from torch import nn

    import gradhealth as gh
    from gradhealth.integrations.tbread import read_run
    from gradhealth.integrations.tensorboard import TensorBoardSink

    model = nn.Module()
    model.add_module("used", nn.Linear(2, 1))
    model.add_module("head\x1b]0;PWNED\x07", nn.Linear(2, 1))
    opt = torch.optim.SGD(model.used.parameters(), lr=0.1)
    sink = TensorBoardSink(str(tmp_path))
    with gh.GradHealth(model, opt, on_problem="ignore", sinks=[sink]) as mon:
        (model.used(torch.ones(1, 2)) + getattr(model, "head\x1b]0;PWNED\x07")(torch.ones(1, 2))).sum().backward()
        mon.check()
    frame = read_run(str(tmp_path), text=True)
    texts = list(frame[frame.tag == "gradhealth/findings_text"].text)
    assert texts and any("PWNED" in t for t in texts)  # the premise: the name is in the text
    assert any("head\x1b]0;PWNED\x07.weight" in t for t in texts)  # exact: a browser shows it as text
    out = report(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout and "head\\x1b]0;PWNED\\x07" in out.stdout
    csv_out = report(tmp_path, "--format", "csv").stdout
    assert "\x1b" not in csv_out and "head\\x1b]0;PWNED\\x07" in csv_out
    rows = json.loads(report(tmp_path, "--format", "json").stdout)  # JSON gives the names back as they are
    [row] = [r for r in rows if r["kind"] == "NOT_IN_OPTIMIZER"]
    assert set(row["names"]) == {"head\x1b]0;PWNED\x07.weight", "head\x1b]0;PWNED\x07.bias"}


def test_long_texts_are_wrapped_whole_and_names_grouped_with_verbose_listing_all(tmp_path):
    modules = [f"enc.layer{i}.proj" for i in range(12)] + ["head"]
    data = b""
    for s in range(3):
        data += scalars(s, {"gradhealth/grad_norm/total": 1.0, **{f"gradhealth/update_norm/{m}": 0.0 if m != "head" else 1.0
                                                                     for m in modules}})
    data += text(1, "gradhealth/findings_text", "**NOT_UPDATED** (error, step 1): " + "emptying the buffer " * 40)
    data += scalars(1, {"gradhealth/findings/NOT_UPDATED": 1.0})
    os.makedirs(tmp_path / "r")
    (tmp_path / "r" / "events.out.tfevents.1.host").write_bytes(data)
    out = report(tmp_path).stdout
    lines = out.splitlines()
    at = next(k for k, x in enumerate(lines) if "NOT_UPDATED" in x)
    block = " ".join(x.strip() for x in lines[at:at + 12] if x.startswith("  "))
    assert block.count("emptying the buffer") == 40 and "…" not in out  # nothing cut
    assert all(len(x) <= 100 for x in lines if x.startswith("  "))  # wrapped instead
    assert "NEVER_UPDATED: never updated in any measured step: enc.* (12 modules)" in out
    verbose = report(tmp_path, "--verbose").stdout
    assert "enc.layer0.proj, enc.layer1.proj, enc.layer10.proj" in " ".join(verbose.split())  # (wrapped)


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_problem_parameters_are_named_grouped_and_listed_with_verbose(tmp_path):
    import torch

    import gradhealth as gh
    from gradhealth.integrations.tensorboard import TensorBoardSink

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)  # the whole second block is left out
    sink = TensorBoardSink(tmp_path)
    mon = gh.GradHealth(model, opt, sinks=[sink], on_problem="ignore")
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        mon.check()
        opt.step()
    mon.close()
    out = report(tmp_path).stdout
    assert "NOT_IN_OPTIMIZER: 1.* (4 params) NOT_IN_OPTIMIZER from step 0 on (3 checks)" in out
    verbose = report(tmp_path, "--verbose").stdout
    assert "NOT_IN_OPTIMIZER: 1.0.weight, 1.0.bias, 1.1.weight, 1.1.bias NOT_IN_OPTIMIZER from step 0" in verbose
    rows = json.loads(report(tmp_path, "--format", "json").stdout)
    [row] = [r for r in rows if r["kind"] == "NOT_IN_OPTIMIZER"]
    assert row["names"] == ["1.0.weight", "1.0.bias", "1.1.weight", "1.1.bias"]


def test_the_error_that_stopped_a_run_is_shown(tmp_path):
    import torch

    import gradhealth as gh
    from gradhealth.integrations.tensorboard import TensorBoardSink

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD([model.weight], lr=0.1)
    mon = gh.GradHealth(model, opt, sinks=[TensorBoardSink(tmp_path)], on_problem="raise")
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(gh.GradHealthError):
        mon.check()
    out = report(tmp_path).stdout
    assert "STOPPED: training stopped at step 0: GradHealthError: gradhealth step 0: 1 NOT_IN_OPTIMIZER" in out
    assert "NOT_IN_OPTIMIZER: bias NOT_IN_OPTIMIZER from step 0 on (1 check)" in out


@pytest.mark.slow
def test_memory_stays_bounded_on_a_24_mb_log(tmp_path):
    big, small = tmp_path / "big", tmp_path / "small"
    os.makedirs(big)
    values = {f"gradhealth/grad_norm/block{i}.layer": 0.5 for i in range(120)}
    values.update({"gradhealth/grad_norm/total": 1.0, "gradhealth/status/OK": 240.0, "gradhealth/tolerated": 0.0})
    record_at = scalars_at_every_step(values)
    with open(big / "events.out.tfevents.1.host", "wb") as f:
        step = 0
        while f.tell() < 24 * 2**20:
            f.write(record_at(step))
            step += 1
    for k in (0, 1, step // 2, step - 1):  # (the same bytes as the plain writer's, at the first steps and the last)
        assert record_at(k) == scalars(k, values), k
    problem_run(small)
    code = ("import resource, sys; from gradhealth.cli import main; rc = main(['report', sys.argv[1], '--format', 'json']); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)")

    def peak_kib(d):
        res = procs.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=600,
                        env={**os.environ, "PYTHONPATH": ROOT})
        assert res.returncode == 0, res.stderr[-2000:]
        return int(res.stderr.strip().splitlines()[-1])

    grown = peak_kib(big) - peak_kib(small)
    assert grown < 10 * 1024, f"peak RSS grew by {grown / 1024:.0f} MiB reading a 24 MiB log"  # (read whole: > 24)


def test_bit_flips_in_a_real_event_file_never_invent_a_tag_or_a_value(tmp_path):
    import glob
    import random

    import torch
    from torch import nn

    import gradhealth as gh
    from gradhealth.integrations.tensorboard import TensorBoardSink, read_run

    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    mon = gh.GradHealth(m, opt, sinks=[TensorBoardSink(str(tmp_path / "run"))], on_problem="ignore")
    for _ in range(20):
        opt.zero_grad()
        m(torch.randn(4, 3)).sum().backward()
        mon.check()
        opt.step()
    mon.close()
    [path] = glob.glob(str(tmp_path / "run" / "**" / "events*"), recursive=True)
    good = read_run(str(tmp_path / "run"))
    tags, values = set(good.tag), set(zip(good.step, good.tag, good.value))
    raw = open(path, "rb").read()
    rng = random.Random(0)
    skipped_said = 0
    for k in range(200):
        flipped = bytearray(raw)
        i = rng.randrange(len(flipped))
        flipped[i] ^= 1 << rng.randrange(8)
        where = tmp_path / f"flip{k}"
        where.mkdir()
        (where / os.path.basename(path)).write_bytes(bytes(flipped))
        try:
            df = read_run(str(where))
        except ValueError:  # nothing readable at all: said, exit 2 in the CLI
            continue
        assert set(df.tag) <= tags, k  # never a tag that was never logged
        assert set(zip(df.step, df.tag, df.value)) <= values, k  # never a value
        skipped_said += len(df) < len(good)
    assert skipped_said > 10  # the premise: flips did land in scalar records (most land in the layout, text, images)


def test_the_nonfinite_count_says_modules_and_all_only_when_it_is_all(tmp_path):
    data = b""
    mods = ["body.0", "body.1", "head"]
    for s in range(3):
        norms = {f"gradhealth/grad_norm/{m}": (float("nan") if s == 1 and m == "head" else 1.0) for m in mods}
        data += scalars(s, {"gradhealth/grad_norm/total": float("nan") if s == 1 else 1.0, **norms})
    os.makedirs(tmp_path / "r")
    (tmp_path / "r" / "events.out.tfevents.1.host").write_bytes(data)
    out = " ".join(report(tmp_path).stdout.split())
    assert "first non-finite gradients at step 1 in head" in out and "all" not in out.split("step 1 in")[1][:20]
