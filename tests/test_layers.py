"""The core shows its pipeline (docs/design.md, "Layout"): ``gradhealth/`` is grouped in subpackages by
the stages of a check, and imports between the groups run one way, down. Read from the source (every
import, at the top or inside a function), so an import added anywhere is seen."""

import ast
import os
import re

import pytest

import gradhealth

HERE = os.path.dirname(gradhealth.__file__)
ROOT = os.path.dirname(HERE)
#: the stages, bottom to top: a module may import its own group and the groups before it. The modules at
#: the top of ``gradhealth/`` (the facade, options, the user's helpers, the command) sit above them all.
STAGES = ("base", "model", "measure", "ranks", "origin", "judge", "publish", "check")
TOP = "top"


def modules() -> dict[str, str]:
    """{dotted name under gradhealth ("judge.verdict", "monitor", "judge" for its __init__): path}."""
    out = {}
    for folder, _, files in os.walk(HERE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), HERE)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    return out


def group(name: str) -> str:
    first = name.split(".")[0]
    return first if first in STAGES else TOP


def imports(name: str, path: str, known) -> list[tuple[str, int]]:
    """The core modules (or packages) ``name`` imports, with the line: relative imports resolved by
    their level, absolute ``gradhealth.x`` ones too; ``from . import x`` is the module x where there is
    one. An import that names nothing in the tree is an error: no alias may hide an edge."""
    package = [] if name == "__init__" else name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                assert len(base) == len(package) - node.level + 1, f"{name}:{node.lineno}: beyond the package"
                target = base + (node.module.split(".") if node.module else [])
            elif (node.module or "").split(".")[0] == "gradhealth":
                target = node.module.split(".")[1:]
            else:
                continue
            if target[:1] in (["integrations"], ["demos"], ["benchmarks"], ["configs"]):
                continue  # (the folders mapped in: the command's, never a stage's; test_imports holds them apart)
            dotted = ".".join(target)
            for alias in node.names:
                sub = f"{dotted}.{alias.name}" if dotted else alias.name
                hit = sub if sub in known else dotted
                assert hit in known or hit == "", f"{name}:{node.lineno}: imports {sub!r}, which is not in the tree"
                out.append((hit, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "gradhealth" and len(parts) > 1 and parts[1] in STAGES + ("monitor", "options"):
                    out.append((".".join(parts[1:]), node.lineno))
    return [(t, line) for t, line in out if t]


def graph() -> dict[str, list[tuple[str, int]]]:
    mods = modules()
    return {name: imports(name, path, mods) for name, path in mods.items()}


def upward(edges: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Every import that runs from a group to a group above it, as ``group -> group: module:line imports
    module``. The order is total, so a group-level cycle has at least one such import."""
    order = {g: i for i, g in enumerate(STAGES + (TOP,))}
    bad = []
    for a, targets in sorted(edges.items()):
        for b, line in targets:
            if order[group(b)] > order[group(a)]:
                bad.append(f"{group(a)} -> {group(b)}: {a}:{line} imports {b}")
    return bad


def group_cycles(edges) -> list[list[str]]:
    """The cycles of the graph of groups (an edge wherever one module imports another group's)."""
    g: dict[str, set[str]] = {}
    for a, targets in edges.items():
        for b, _ in targets:
            if group(a) != group(b):
                g.setdefault(group(a), set()).add(group(b))
    cycles, state = [], {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                cycles.append(path[path.index(m):] + [m])
            elif m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [n])
    return cycles


def test_every_stage_is_a_package_of_its_own_folder_and_nothing_else_groups_the_core():
    folders = sorted(d for d in os.listdir(HERE) if os.path.isdir(os.path.join(HERE, d)) and d != "__pycache__")
    assert folders == sorted(STAGES), folders
    for stage in STAGES:
        assert os.path.isfile(os.path.join(HERE, stage, "__init__.py")), stage
    top = sorted(f[:-3] for f in os.listdir(HERE) if f.endswith(".py"))
    assert top == ["__init__", "__main__", "cli", "masking", "monitor", "options", "testing"], top


def test_the_groups_import_one_way():
    edges = graph()
    # the premise: the reader sees real edges, relative and inside functions, across groups
    assert any(b == "measure.stats" for b, _ in edges["judge.classify"])
    assert any(b == "origin.calls" for b, _ in edges["judge.guards"])  # (an import inside ForwardWatch.__init__)
    assert sum(len(v) for v in edges.values()) > 300
    bad = upward(edges)
    assert not bad, "imports that run back up:\n" + "\n".join(bad)
    assert not group_cycles(edges), group_cycles(edges)


def test_a_stage_package_imports_nothing():
    """``import gradhealth.judge`` runs only its docstring: a stage never pulls another in by its name."""
    edges = graph()
    for stage in STAGES:
        assert edges[stage] == [], (stage, edges[stage])
        doc = ast.get_docstring(ast.parse(open(os.path.join(HERE, stage, "__init__.py")).read()))
        assert doc and len(doc) > 150, stage  # what it holds, and where a new thing of its kind goes


#: the imports that made pairs of groups import each other both ways before the grouping (the nine pairs of
#: issue 69's count, by the stage each module's code belongs to), each written as it would read in today's
#: tree: the module on the left importing the one on the right
BEFORE = [
    ("measure.observe", "judge.guards"),  # observe -> guards (ForwardRecord); guards -> observe's record now
    ("measure.deltas", "judge.unstepped"),  # deltas -> stale, stale counted a judge there
    ("measure.stats", "judge.classify"),  # deferred -> classify, deferred a measuring module then
    ("model.params", "judge.classify"),  # params -> classify (named_parameters)
    ("origin.replay", "judge.classify"),  # replay -> classify (check_model)
    ("origin.trace", "judge.classify"),
    ("ranks.crossrank", "judge.guards"),  # crossrank -> guards (ForwardRecord)
    ("model.experts", "measure.stats"),  # experts -> stats (fetch, for the slices' re-check)
    ("measure.observe", "ranks.ddp"),  # observe -> distributed, the plumbing and the DDP watch in one module
    ("model.masters", "ranks.ddp"),  # masters -> distributed (to_local)
]


@pytest.mark.parametrize("importer,imported", BEFORE, ids=[f"{a}->{b}" for a, b in BEFORE])
def test_each_import_that_ran_both_ways_before_fails_the_check_naming_its_pair(importer, imported):
    edges = graph()
    assert importer in edges and imported in edges  # the premise: both modules are in the tree
    assert not upward(edges)
    planted = {**edges, importer: edges[importer] + [(imported, 1)]}
    assert upward(planted) == [f"{group(importer)} -> {group(imported)}: {importer}:1 imports {imported}"]
    assert group_cycles(planted)  # (a pair of groups importing each other both ways)


def test_any_upward_import_between_any_two_groups_fails():
    edges = graph()
    first = {g: next(m for m in sorted(edges) if group(m) == g and m != g) for g in STAGES + (TOP,)}
    order = STAGES + (TOP,)
    for i, low in enumerate(order):
        for high in order[i + 1:]:
            planted = {**edges, first[low]: edges[first[low]] + [(first[high], 7)]}
            assert upward(planted) == [f"{low} -> {high}: {first[low]}:7 imports {first[high]}"], (low, high)


def test_an_import_of_a_module_that_is_not_in_the_tree_is_an_error(tmp_path):
    """A core module importing an old flat name (``from . import stats`` at the top) names nothing in
    the tree: the reader says so instead of skipping the edge."""
    path = tmp_path / "m.py"
    path.write_text("from .stats import fetch\n")
    with pytest.raises(AssertionError, match="'stats'"):
        imports("monitor", str(path), modules())
    path.write_text("def f():\n    from ..measure.stats import fetch\n")
    assert imports("judge.x", str(path), modules()) == [("measure.stats", 2)]


def test_the_manual_shows_the_tree_as_it_is():
    """docs/design.md's Layout table: one row per group, top to bottom, each naming every module it holds."""
    text = open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8").read()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)/` \|[^|]*\| ([^|]*) \|$", section, re.M)
    assert [g for g, _ in rows] == list(reversed(STAGES)), [g for g, _ in rows]
    mods = modules()
    for g, cell in rows:
        listed = set(re.findall(r"`(\w+)`", cell))
        held = {m.split(".", 1)[1] for m in mods if m.startswith(g + ".")}
        assert listed == held, (g, sorted(listed - held), sorted(held - listed))
    picture = section.split("```text\n", 1)[1].split("```", 1)[0]
    assert all(f"{g}/" in picture for g in STAGES), picture
