"""``python -m gradhealth.configs [NAME]``: the folder of the shipped configs, or one config's path."""

import sys

from . import DIR, path

if len(sys.argv) > 2:
    sys.exit("usage: python -m gradhealth.configs [NAME]")
try:
    print(path(sys.argv[1]) if len(sys.argv) == 2 else DIR)
except ValueError as exc:
    sys.exit(f"gradhealth.configs: {exc}")
