"""Installing gradhealth in another project as the README says: the versions it states are the ones
this suite runs against, the extras it names exist, and a wheel carries what the manual runs
(the LightningCLI configs) and the license."""

import glob
import os
import re
import shutil
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import version

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISTRIBUTIONS = {"torch": "torch", "Lightning": "lightning", "transformers": "transformers", "Accelerate": "accelerate",
                 "DeepSpeed": "deepspeed", "TRL": "trl", "PEFT": "peft"}


def readme_install() -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]


def table(section: str, first: str) -> list[list[str]]:
    """The rows of the section's table whose header starts with ``first``, cells stripped of backticks."""
    lines = section.splitlines()
    at = next(k for k, line in enumerate(lines) if line.startswith("| " + first) or line.startswith("|" + first))
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in line.strip().strip("|").split("|")])
    return rows


def pyproject_requirements() -> dict[str, SpecifierSet]:
    """Every requirement of pyproject.toml (dependencies and extras), by distribution."""
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    found: dict[str, SpecifierSet] = {}
    for spec in re.findall(r'"([A-Za-z][\w.-]*(?:\[[^\]]*\])?\s*[<>=!~][^"]*)"', text):
        req = Requirement(spec)
        found.setdefault(req.name.lower(), req.specifier)
    return found


def test_the_versions_table_is_what_the_suite_runs_against():
    rows = {r[0]: r[1:] for r in table(readme_install(), " | tested with")}
    assert set(rows) == {"Python", *DISTRIBUTIONS}, sorted(rows)
    tested, required = rows["Python"]
    assert tested == f"{sys.version_info.major}.{sys.version_info.minor}", (tested, sys.version)
    requires_python = re.search(r'requires-python = "([^"]+)"', open(os.path.join(ROOT, "pyproject.toml")).read()).group(1)
    assert SpecifierSet(required) == SpecifierSet(requires_python)
    declared = pyproject_requirements()
    wrong = []
    for name, dist in DISTRIBUTIONS.items():
        tested, required = rows[name]
        installed = Version(version(dist)).base_version  # (2.13.0+cpu is 2.13.0)
        if installed != tested:
            wrong.append(f"{name}: the README says {tested}, the suite runs {installed}")
        if SpecifierSet(required) != declared[dist]:
            wrong.append(f"{name}: the README requires {required}, pyproject.toml {declared[dist]}")
        if installed not in SpecifierSet(required):
            wrong.append(f"{name}: {installed} is outside {required}")
    assert not wrong, "\n".join(wrong)


def test_the_readme_names_every_extra_a_user_installs():
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^(\w+) = \[", section, re.M)) - {"dev", "docs"}  # (the repository's own)
    assert {"lightning", "tensorboard", "transformers", "deepspeed", "demo"} <= extras
    listed = {r[0] for r in table(readme_install(), "extra")}
    assert listed == extras, (listed, extras)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy of the files git would commit: setuptools packs whatever an earlier build left in the
    # checkout's build/lib (a module since moved or removed would ship beside its new place)
    src = tmp_path_factory.mktemp("source")
    files = procs.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                      capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(os.path.join(src, name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(src, name))
    proc = procs.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
                     capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = glob.glob(str(out / "gradhealth-*.whl"))
    return path


def test_the_wheel_ships_the_configs_the_license_and_the_extras(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = Parser().parsestr(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    configs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert configs == ["default.yaml", "multiprocess.yaml", "strict.yaml"]  # the premise: what the Lightning page runs
    for c in configs:
        assert f"gradhealth/configs/{c}" in names, (c, [n for n in names if "configs" in n])
    assert any(re.search(r"\.dist-info/(licenses/)?LICENSE$", n) for n in names), names
    assert "Apache License" in open(os.path.join(ROOT, "LICENSE"), encoding="utf-8").read(2000)
    assert {"lightning", "tensorboard", "transformers", "deepspeed", "demo"} <= set(metadata.get_all("Provides-Extra"))
    assert {"gradhealth/integrations/lightning.py", "gradhealth/demos/lightning_fit.py"} <= set(names)


def test_the_wheel_carries_every_module_of_the_core(wheel):
    """Each stage's folder is a package pyproject.toml lists (one left out would install a gradhealth
    whose imports fail outside this checkout), and nothing else ships: no module from before a move."""
    here = os.path.join(ROOT, "gradhealth")
    core = {os.path.relpath(p, ROOT).replace(os.sep, "/") for p in glob.glob(os.path.join(here, "**", "*.py"), recursive=True)}
    assert len(core) > 60 and "gradhealth/judge/verdict.py" in core  # the premise: the stages' modules, found
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    mapped = ("gradhealth/integrations/", "gradhealth/demos/", "gradhealth/benchmarks/", "gradhealth/configs/")
    shipped = {n for n in names if n.startswith("gradhealth/") and n.endswith(".py") and not n.startswith(mapped)}
    assert shipped == core, (sorted(core - shipped), sorted(shipped - core))


@pytest.mark.slow  # (over 10 s: make test runs it, make test-fast does not)
def test_the_configs_are_found_from_an_installed_wheel_in_another_folder(wheel, tmp_path):
    target = tmp_path / "site"
    proc = procs.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                      str(target), wheel], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(target))
    run = lambda *a: procs.run([sys.executable, "-m", "gradhealth.configs", *a], cwd=tmp_path, env=env,  # noqa: E731
                               capture_output=True, text=True, timeout=120)
    folder = run().stdout.strip()
    assert folder.startswith(str(target)) and os.path.isdir(folder), folder
    path = run("default.yaml").stdout.strip()
    assert path.startswith(str(target)) and open(path).read().startswith("# gradhealth with TensorBoard")
    wrong = run("nope")
    assert wrong.returncode != 0 and "default.yaml" in wrong.stderr  # (names the configs there are)
