"""The LightningCLI configs of the manual's Lightning page, shipped inside the package.

``python -m gradhealth.configs`` prints the folder that holds them, ``python -m gradhealth.configs
default.yaml`` the path of one, so a run from any folder reads::

    python -m gradhealth.integrations.cli fit --config "$(python -m gradhealth.configs default.yaml)"
"""

from __future__ import annotations

import os

DIR = os.path.dirname(os.path.abspath(__file__))


def names() -> list[str]:
    """The configs shipped (``default.yaml``, ...)."""
    return sorted(f for f in os.listdir(DIR) if f.endswith(".yaml"))


def path(name: str) -> str:
    """The path of the shipped config ``name`` (``"default.yaml"`` or ``"default"``)."""
    file = name if name.endswith(".yaml") else name + ".yaml"
    if file not in names():
        raise ValueError(f"no config named {name!r}; the configs are: {', '.join(names())}")
    return os.path.join(DIR, file)
