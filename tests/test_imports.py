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

    assert os.path.basename(os.path.dirname(list(gi.__path__)[0].rstrip(os.sep) + os.sep)) == "integrations"
