import subprocess
import sys


def test_core_imports_no_framework():
    code = (
        "import sys, gradhealth, gradhealth.monitor, gradhealth.stats, gradhealth.classify, gradhealth.guards;"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('lightning','pytorch_lightning','tensorboard','tensorboardX','matplotlib')"
        " or m.startswith('torch.utils.tensorboard')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_integrations_package_maps_to_top_level_folder():
    import os

    import gradhealth.integrations as gi

    import gradhealth

    where = os.path.realpath(list(gi.__path__)[0])
    core = os.path.realpath(os.path.dirname(gradhealth.__file__))
    # the top-level integrations/ folder beside gradhealth/, not a folder inside the core
    assert os.path.basename(where) == "integrations"
    assert os.path.dirname(where) == os.path.dirname(core) and not where.startswith(core + os.sep)
