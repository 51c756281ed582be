"""The built manual as a reader meets it (``mkdocs build --strict`` into a temporary folder): the API
page answers every name a recipe uses, with its module path, in one docstring style that renders
(no raw Sphinx roles), the options whole; the 404 page's links hold where the site is published."""

import ast
import dataclasses
import html
import inspect
import os
import re
import sys
from html.parser import HTMLParser

import pytest
import torch
from torch import nn

import gradhealth as gh
from test_docs import blocks, pages
import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLE = re.compile(r":(class|meth|func|mod|attr|exc|data|obj|ref):")


def build(site, **env) -> None:
    proc = procs.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                     env=dict(os.environ, NO_MKDOCS_2_WARNING="1", **env), capture_output=True, text=True,
                     timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    path = tmp_path_factory.mktemp("site")
    build(path)
    return path


def test_the_manual_builds_strict(site):
    """``mkdocs build --strict`` (``site``'s build: a failed one fails here): a broken link, a missing
    anchor or an API reference that does not resolve fails the build."""
    assert (site / "index.html").exists() and (site / "api" / "index.html").exists()


class Page(HTMLParser):
    """The text of a page, and of each heading (by its id) with where it starts in the text."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.headings: list[tuple[int, str, int, str]] = []  # (level, id, offset in the text, heading text)
        self._open: tuple[int, str, int] | None = None
        self._skip = 0
        self.feed(text)
        self.text = "".join(self.parts)

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        if re.fullmatch(r"h[1-6]", tag) and dict(attrs).get("id"):
            self._open = (int(tag[1]), dict(attrs)["id"], sum(map(len, self.parts)))

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1
        if self._open and tag == f"h{self._open[0]}":
            level, ident, start = self._open
            words = " ".join("".join(self.parts)[start:].split()).rstrip("¶").strip()
            self.headings.append((level, ident, start, words))
            self._open = None

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data + " ")

    def section(self, ident: str) -> str:
        """The text under heading ``ident`` up to the next heading at its level or above."""
        at = next(k for k, h in enumerate(self.headings) if h[1] == ident)
        level, _, start, _ = self.headings[at]
        end = next((h[2] for h in self.headings[at + 1:] if h[0] <= level), len(self.text))
        return self.text[start:end]


def api(site) -> Page:
    return Page(open(os.path.join(site, "api", "index.html"), encoding="utf-8").read())


# ------------------------------------------------------------ what the recipes use
def recipe_trees():
    for page in pages():
        for line, code, _ in blocks(page):
            yield page, line, ast.parse(code)


def used_names():
    """(``gh.X`` names, ``from gradhealth... import Y`` paths, attribute names) of every python block
    of the README and the manual."""
    gh_names, imported, attributes = set(), set(), {}
    for page, line, tree in recipe_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                if isinstance(node.value, ast.Name) and node.value.id == "gh":
                    gh_names.add(node.attr)
                else:
                    attributes.setdefault(node.attr, f"{page}:{line + node.lineno}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradhealth"):
                imported.update(f"{node.module}.{a.name}" for a in node.names)
    return gh_names, imported, attributes


def public(obj) -> set[str]:
    return {a for a in dir(obj) if not a.startswith("_")}


def reachable():
    """Each public class a recipe gets an instance of, by its documented path, with the public names
    of a real instance (instance attributes included)."""
    from lightning.pytorch.callbacks import Callback
    from transformers import TrainerCallback

    from gradhealth.integrations.lightning import GradHealthCallback as LightningCallback
    from gradhealth.integrations.tensorboard import TensorBoardSink
    from gradhealth.integrations.transformers import GradHealthCallback as HFCallback

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with gh.GradHealth(model, opt, on_problem="ignore", expect_frozen=[]) as monitor:
        model(torch.randn(2, 4)).sum().backward()
        report = monitor.check()
    model[2].weight.requires_grad_(False)
    finding = gh.GradHealth(model, opt, on_problem="ignore", expect_frozen=[]).check().findings[0]
    with gh.trace_nonfinite(model) as tracer:
        model(torch.randn(2, 4)).sum().backward()
    return {
        "gradhealth.GradHealth": public(monitor), "gradhealth.Report": public(report),
        "gradhealth.Finding": public(finding), "gradhealth.NonFiniteTracer": public(tracer),
        # (what a callback adds to its framework's own Callback)
        "gradhealth.integrations.lightning.GradHealthCallback": public(LightningCallback()) - public(Callback),
        "gradhealth.integrations.transformers.GradHealthCallback": public(HFCallback()) - public(TrainerCallback),
        "gradhealth.integrations.tensorboard.TensorBoardSink": public(TensorBoardSink),
        "gradhealth.NormHistory": public(gh.NormHistory()),
    }


# ------------------------------------------------------------------------ tests
def test_no_raw_sphinx_roles_anywhere_on_the_site(site):
    raw = []
    for folder, _, files in os.walk(site):
        for f in files:
            if f.endswith(".html"):
                text = Page(open(os.path.join(folder, f), encoding="utf-8").read()).text
                raw += [f"{os.path.relpath(os.path.join(folder, f), site)}: ...{text[max(0, m.start() - 40):m.end() + 40]}..."
                        for m in ROLE.finditer(text)]
    assert not raw, "raw roles rendered as text:\n" + "\n".join(raw)


def test_every_object_heading_shows_its_module_path_once(site):
    page = api(site)
    objects = [(ident, words) for level, ident, _, words in page.headings if level == 3]
    assert len(objects) >= 30  # the premise: the page renders its objects
    for ident, words in objects:
        assert ident.startswith("gradhealth."), ident
        assert words.split()[0] == ident, (ident, words)  # the heading reads the path one imports
    shown = [w.split()[0] for _, w in objects]
    assert len(shown) == len(set(shown)), sorted(w for w in shown if shown.count(w) > 1)


def test_every_name_a_recipe_uses_is_on_the_api_page(site):
    page = api(site)
    ids = {h[1] for h in page.headings}
    gh_names, imported, attributes = used_names()
    assert {"GradHealth", "Status"} <= gh_names and "last_report" in attributes  # the premise
    missing = []
    for name in sorted(gh_names):
        defined = f"{getattr(gh, name).__module__}.{name}"
        if f"gradhealth.{name}" not in ids and defined not in ids:
            missing.append(f"gh.{name}")
    missing += [path for path in sorted(imported) if path not in ids]
    for cls, names in reachable().items():
        assert cls in ids, f"{cls} has no entry on the API page"
        text = page.section(cls)
        for attr in sorted(set(attributes) & names):
            if not re.search(rf"(?<![\w.]){re.escape(attr)}(?!\w)", text):
                missing.append(f"{cls}.{attr} (used at {attributes[attr]})")
    assert not missing, "used in a recipe, not on the API page: " + ", ".join(missing)


def test_the_options_are_listed_whole(site):
    from gradhealth.integrations.lightning import GradHealthCallback as LightningCallback
    from gradhealth.integrations.transformers import GradHealthCallback as HFCallback

    page = api(site)
    table = page.section("options")
    names = [f.name for f in dataclasses.fields(gh.Options)]
    assert {"on_problem", "lag", "every_n_steps"} <= set(names)  # the premise
    for callback in (LightningCallback, HFCallback):
        names += [p for p in inspect.signature(callback).parameters if p != "options"]
    assert "granularity" in names
    missing = [n for n in names if not re.search(rf"(?<![\w.]){n}(?!\w)", table)]
    assert not missing, f"options not in the API page's option list: {missing}"
    documented = gh.Options.__doc__
    missing = [f.name for f in dataclasses.fields(gh.Options) if f"{f.name}:" not in documented]
    assert not missing, f"gh.Options's docstring leaves out {missing}"


def test_the_404_page_links_hold_where_the_site_is_published(tmp_path):
    """Served from a sub-path (``GRADHEALTH_SITE_URL``), the 404 page's links go under it and to
    pages that exist (without ``site_url`` they went to the server's root)."""
    build(tmp_path, GRADHEALTH_SITE_URL="https://example.org/docs/gradhealth/")
    text = open(tmp_path / "404.html", encoding="utf-8").read()
    links = [html.unescape(u) for u in re.findall(r'(?:href|src)="([^"]+)"', text)]
    local = [u for u in links if not re.match(r"[a-z]+://", u)]
    assert any(u.rstrip("/").endswith("api") for u in local)  # the premise: the nav is there
    for u in local:
        assert u.startswith("/docs/gradhealth/"), u
        rest = u[len("/docs/gradhealth/"):].split("#")[0]
        target = tmp_path / rest
        assert target.exists() and (target.is_file() or (target / "index.html").exists()), u
