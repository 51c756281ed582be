import importlib
import os
import pkgutil
import sys

import pytest

import gradhealth
import procs

# tools that live in the package but are never imported by it
TOOLS = {"__main__"}
# every module of the core, by its dotted name under gradhealth (its stages' subpackages included)
CORE = sorted(m.name[len("gradhealth."):] for m in pkgutil.walk_packages(gradhealth.__path__, "gradhealth.")
              if m.name.rsplit(".", 1)[-1] not in TOOLS and not m.ispkg)


def test_core_modules_import_no_framework_demo_or_bench():
    assert {"monitor", "measure.observe", "ranks.crossrank", "judge.judges", "check.carry", "publish.policy", "options",
            "measure.layout"} <= set(CORE)
    code = (
        "import importlib, sys\n"
        f"for m in {CORE!r}: importlib.import_module('gradhealth.' + m)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'tensorboard',"
        " 'tensorboardX', 'matplotlib', 'transformers', 'peft', 'accelerate')"
        " or m.startswith(('torch.utils.tensorboard', 'gradhealth.integrations', 'gradhealth.demos', 'gradhealth.benchmarks'))]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    out = procs.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("package", ["integrations", "demos", "benchmarks"])
def test_adapters_demos_and_benchmarks_map_to_their_own_top_level_folders(package):
    mod = importlib.import_module("gradhealth." + package)
    where = os.path.realpath(list(mod.__path__)[0])
    core = os.path.realpath(os.path.dirname(gradhealth.__file__))
    # the top-level folder beside gradhealth/, not a folder inside the core
    assert os.path.basename(where) == package
    assert os.path.dirname(where) == os.path.dirname(core) and not where.startswith(core + os.sep)


def test_adapters_hold_no_demo_or_benchmark():
    import gradhealth.integrations as gi

    names = {m.name for m in pkgutil.iter_modules(gi.__path__)}
    assert not {n for n in names if "demo" in n or "bench" in n}, names


def test_no_core_module_is_too_long_to_read():
    here = os.path.dirname(gradhealth.__file__)
    long = {m: n for m in CORE if (n := sum(1 for _ in open(os.path.join(here, *m.split(".")) + ".py"))) > 420}
    assert not long, long


def test_no_import_cycle_in_the_core():
    """Two modules that import each other (even inside a function) hold something that belongs to one
    of them or to a third, lower module (the imports as tests/test_layers.py reads them)."""
    from test_layers import cycles, graph

    edges = {m: {b for b, _ in targets} for m, targets in graph().items() if m != "__init__"}
    assert "base.distributed" in edges["ranks.replicas"]  # the check reads real edges
    found = cycles(edges)
    assert not found, found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]  # (it finds one)


def test_the_report_command_reads_a_log_without_importing_torch(tmp_path):
    """``gradhealth report`` needs no torch (2 s of CPU a command otherwise): the package's public
    names load at their first use, and the report's modules import none of torch's."""
    code = ("import sys; from gradhealth.cli import main; rc = main(['report', sys.argv[1]]); "
            "print('torch' in sys.modules, file=sys.stderr); sys.exit(0)")
    res = procs.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.stderr.strip().splitlines()[-1] == "False", res.stderr[-2000:]


def test_every_public_name_resolves_lazily_and_as_before():
    """What ``import gradhealth`` offered when it imported every module: each name of ``__all__``
    (``from gradhealth import *`` too), the submodules as attributes (``gh.monitor``, each stage: ``gh.judge``),
    and ``gh.brief`` / ``gh.classify`` the functions even after their modules were imported; an unknown name
    says so, and a module of the flat layout before the stages says where it is now."""
    code = """
import gradhealth as gh, gradhealth.publish.brief, gradhealth.judge.classify, types
assert callable(gh.brief) and not isinstance(gh.brief, types.ModuleType)
assert callable(gh.classify) and not isinstance(gh.classify, types.ModuleType)
ns = {}
exec("from gradhealth import *", ns)
assert all(ns[n] is getattr(gh, n) for n in gh.__all__)
assert gh.GradHealth.__module__ == "gradhealth.monitor" and gh.monitor.GradHealth is gh.GradHealth
assert set(gh.__all__) <= set(dir(gh))
assert gh.judge.__name__ == "gradhealth.judge" and gh.measure.__name__ == "gradhealth.measure"
try:
    gh.stats
except AttributeError as e:
    assert "gradhealth.measure.stats" in str(e), e
else:
    raise AssertionError("gh.stats resolved")
assert not hasattr(gh, "a.b") and not hasattr(gh, "")  # (a name that cannot be a module's: no import tried)
try:
    gh.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("gh.no_such_name resolved")
"""
    res = procs.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
