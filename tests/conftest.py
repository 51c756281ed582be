import math
import os
import random
import signal
import socket
import warnings

import deepspeed_ops
import procs

# DeepSpeed's ops come from the checkout's own cache (built by scripts/ensure-deps test), for this
# process and every process the suite starts: the user's ~/.cache/torch_extensions is never touched.
os.environ["TORCH_EXTENSIONS_DIR"] = str(deepspeed_ops.CACHE)
# One intra-op thread in the test processes and in every process they start (inherited): the suite's
# models are tiny and `make test` runs two workers on two cores, so a second OpenMP thread per process
# only oversubscribes them, and its spin-waits burn CPU (a section of scripts/gpu_check.py: 17 s of
# CPU on two threads, 3 s on one, on the busy 2-core machine). A value the user set is kept.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import gradhealth as gh  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # (in case torch was imported before this file)

warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")


@pytest.fixture(scope="session", autouse=True)
def _no_stale_build_lock():
    """A build lock no build will release (one killed half-way) would make DeepSpeed wait on it forever."""
    deepspeed_ops.clear_stale_locks(say=lambda message: warnings.warn(message, stacklevel=1))


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state (torch's and Python's), whatever its worker ran
    before: a test that draws its weights without a seed of its own (a healthy control whose loss must
    fall, a planted bug) is the same run in every order of the suite (found: a Lightning control whose
    loss fell under one order of the files and not under another)."""
    random.seed(0)
    torch.manual_seed(0)


def pytest_sessionstart(session):
    """DeepSpeed's ops, built before any test when `make deps` has not built them (a plain `pytest`
    on a fresh checkout), so no test's timeout lands in a build; not in xdist's workers (their
    controller built them) nor when slow tests (every DeepSpeed case) are deselected."""
    config = session.config
    if hasattr(config, "workerinput") or "not slow" in (config.option.markexpr or ""):
        return
    from importlib.util import find_spec

    if find_spec("deepspeed") is None or deepspeed_ops.is_built():
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter is not None else print
    try:
        deepspeed_ops.build(say=say)
    except (TimeoutError, RuntimeError) as exc:  # (the DeepSpeed cases then fail with it; the rest runs)
        say(f"gradhealth tests: {exc}")


def pytest_configure(config):
    """SIGTERM (a CI job cancelled, `timeout`) ends the run as Ctrl-C does, so its cleanup runs: the
    default action would end pytest at once and leave every process group a test started running.
    Under ``--dist loadfile`` xdist hands out files in the order the workers collected them (this
    file's pytest_collection_modifyitems: longest first), not re-sorted by their count of tests."""
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False  # (xdist's default: files with the most tests first)


#: Seconds each test file takes, about (its tests' durations in a `make test` run on 2 idle cores,
#: 2026-12-07, the files of 5 s or more): only their order matters, longest first. A file not listed
#: (they took under 5 s) counts DEFAULT_SECONDS.
FILE_SECONDS = {
    "test_deepspeed.py": 70, "test_docs_frameworks.py": 96, "test_lightning_ddp.py": 66, "test_replicas.py": 13,
    "test_fabric_ddp.py": 57, "test_procs.py": 53, "test_launch_budget.py": 52, "test_meshes.py": 17,
    "test_distributed.py": 7, "test_bench_command.py": 37, "test_leave_on.py": 36, "test_docs.py": 30,
    "test_idioms.py": 28, "test_demo.py": 28, "test_cli_configs.py": 24, "test_transformers.py": 24,
    "test_transformers_ddp.py": 18, "test_gpu_check.py": 18, "test_docs_output.py": 7, "test_deepspeed_ops.py": 16,
    "test_tensorboard.py": 9, "test_tensorboard_cost.py": 13, "test_accelerate_ddp.py": 13,
    "test_reduce_places.py": 5, "test_lrstory.py": 12, "test_fitted.py": 12, "test_report_robust.py": 11,
    "test_real_models.py": 10, "test_install.py": 9, "test_patience.py": 9, "test_instruction_budget.py": 9,
    "test_trl.py": 9, "test_docs_site.py": 8, "test_trace_clean.py": 8, "test_robust_hooks.py": 5,
    "test_imports.py": 7, "test_fastai.py": 6, "test_deferred.py": 6,
}
DEFAULT_SECONDS = 2.0


def pytest_collection_modifyitems(config, items):
    """In xdist's workers, the test files longest first (their tests in their own order): with
    ``--dist loadfile`` a worker takes the next file when it is nearly done with its last, so a long
    file taken last would run alone at the end while the other worker idles. The same order on every
    worker (a fixed table, a stable sort), as xdist requires; a run without xdist keeps its order."""
    if not hasattr(config, "workerinput"):
        return
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, DEFAULT_SECONDS))


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_sessionfinish(session):
    """The process groups a test started and left alive (tests/procs.py), killed, and said."""
    left = procs.sweep()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if left and reporter is not None:
        reporter.write_line(f"gradhealth tests: killed {len(left)} process group(s) a test left alive: {left}")


def naive_classify(model, optimizer=None):
    """The seed-style per-parameter loop: the oracle. Densifies sparse grads (torch's isfinite and
    norms refuse sparse tensors)."""
    ids = None
    if optimizer is not None:
        opts = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        ids = {id(p) for o in opts for g in o.param_groups for p in g["params"]}
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            out[name] = gh.Status.FROZEN
            continue
        if p.grad is None:
            out[name] = gh.Status.NO_GRAD
            continue
        g = p.grad.to_dense() if p.grad.is_sparse else p.grad
        if not torch.isfinite(g).all():
            out[name] = gh.Status.NON_FINITE_GRAD
        elif ids is not None and id(p) not in ids:
            out[name] = gh.Status.NOT_IN_OPTIMIZER
        elif (g == 0).all():
            out[name] = gh.Status.ZERO_GRAD
        else:
            out[name] = gh.Status.OK
    return out


def reference_norm(grad):
    g = grad.to_dense() if grad.is_sparse else grad
    return torch.linalg.vector_norm(g.to(torch.float64)).item()


def same_float(a, b, rel=1e-5):
    if math.isnan(b):
        return math.isnan(a)
    if math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MLP(torch.nn.Module):
    def __init__(self, d_in=8, d_hidden=16, d_out=4):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.ReLU(), torch.nn.Linear(d_hidden, d_hidden))
        self.head = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return MLP()


def run_spawned(fn, attempts=2, fresh=()):
    """Run a Lightning ddp_spawn fit; retry once when a worker died of SIGABRT (gloo's teardown can
    abort a process that already finished its work; seen once in ~12 suite runs). Any other failure,
    gradhealth's errors included, propagates at once. The folders in `fresh` (where the fit writes its
    logs) are removed before every attempt, so a relaunch leaves one run behind, not two."""
    import os
    import shutil

    from torch.multiprocessing.spawn import ProcessExitedException

    for attempt in range(attempts):
        os.environ.pop("MASTER_PORT", None)  # a fresh port for every launch
        for folder in fresh:
            shutil.rmtree(folder, ignore_errors=True)
        try:
            with procs.children_killed():  # (its ranks, on a failure, a timeout or Ctrl-C)
                return fn()
        except ProcessExitedException as exc:
            if "SIGABRT" not in str(exc) or attempt == attempts - 1:
                raise


@pytest.fixture
def one_thread():
    """Tiny models run faster and reproducibly on one thread (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class CountClips:
    """Counts the clips that read every gradient for their norm: ``torch.nn.utils.clip_grad_norm_``
    (Lightning, older Accelerate) or ``torch.nn.utils.get_total_norm`` (Accelerate 1.16's
    DTensor-aware clip: one per device mesh, then ``clip_grads_with_norm_``). torch's own clip calls
    its private ``_get_total_norm``, so no clip is counted twice."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in ("clip_grad_norm_", "get_total_norm"):
            original = getattr(torch.nn.utils, name)

            def counted(*args, _original=original, **kw):
                self.calls += 1
                return _original(*args, **kw)

            monkeypatch.setattr(torch.nn.utils, name, counted)
