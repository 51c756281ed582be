import os
import pkgutil
import subprocess
import sys

import gradhealth

# tools that live in the package but are never imported by it
TOOLS = {"demo", "bench", "bench_experts", "bench_many", "__main__"}
CORE = sorted(m.name for m in pkgutil.iter_modules(gradhealth.__path__) if m.name not in TOOLS)


def test_core_modules_import_no_framework_demo_or_bench():
    assert {"monitor", "observe", "crossrank", "judges", "carry", "policy", "options", "layout"} <= set(CORE)
    code = (
        "import importlib, sys\n"
        f"for m in {CORE!r}: importlib.import_module('gradhealth.' + m)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'tensorboard',"
        " 'tensorboardX', 'matplotlib', 'transformers', 'peft', 'accelerate')"
        " or m.startswith(('torch.utils.tensorboard', 'gradhealth.integrations', 'gradhealth.demo', 'gradhealth.bench'))]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_integrations_package_maps_to_top_level_folder():
    import gradhealth.integrations as gi

    where = os.path.realpath(list(gi.__path__)[0])
    core = os.path.realpath(os.path.dirname(gradhealth.__file__))
    # the top-level integrations/ folder beside gradhealth/, not a folder inside the core
    assert os.path.basename(where) == "integrations"
    assert os.path.dirname(where) == os.path.dirname(core) and not where.startswith(core + os.sep)


def test_no_core_module_is_too_long_to_read():
    here = os.path.dirname(gradhealth.__file__)
    long = {m: n for m in CORE if (n := sum(1 for _ in open(os.path.join(here, m + ".py")))) > 420}
    assert not long, long
