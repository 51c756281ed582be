"""A Griffe extension for the manual's API page (mkdocs.yml): the folders that setuptools maps into
the package (``integrations/`` is ``gradhealth.integrations``, ``demos/`` is ``gradhealth.demos``,
pyproject.toml's package-dir) are documented under the names a user imports, so their headings read
``gradhealth.integrations.lightning.GradHealthCallback``, not ``integrations.lightning...``."""

from __future__ import annotations

import re
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent


def mapped() -> dict[str, str]:
    """{member of gradhealth: folder} from pyproject.toml's ``[tool.setuptools.package-dir]``."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]  # (3.10 has no tomllib)
    dirs = dict(re.findall(r'^"gradhealth\.(\w+)"\s*=\s*"([^"]+)"', section, re.M))
    return {name: folder for name, folder in dirs.items() if (ROOT / folder / "__init__.py").exists()}


class MappedPackages(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "gradhealth":
            return
        for member, folder in mapped().items():
            if member not in pkg.members:
                pkg.set_member(member, loader.load(folder))
