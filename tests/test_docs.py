"""The README and the manual (docs/): every python block runs (the site's ``--strict`` build:
tests/test_docs_site.py).

Each page's python blocks run in order, as a reader would paste them, in one process of their own
where gradhealth was never imported: forked from tests/page_server.py's fork server, which imported
torch and the frameworks of the file's pages (never gradhealth), so a page's globals meet no other
page's. The blocks carry their own stand-ins (a tiny model, synthetic data) and their own asserts: a
healthy run silent under ``on_problem="raise"``, a planted bug named. A block that cannot run here
says why in a visible ``<!-- not-run: reason -->`` comment on the line before it.
"""

import glob
import os
import re
import textwrap

import pytest

import gradhealth as gh
from conftest import free_port
import page_server as page_server_mod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^( *)```python[^\n]*\n(.*?)^\1```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not-run: (.+?) -->\s*$")
#: ``print(e)   # gradhealth step 0: ... 2.* (2 params)``: what a page shows that line prints, checked
#: as the page runs (``...`` stands for what the comment leaves out)
SHOWN = re.compile(r"^(\s*)print\((\w+)\)\s+# (gradhealth step .*)$", re.M)
_SHOWS = """
def _shows(value, shown):
    printed, at = " ".join(str(value).split()), 0
    for part in (" ".join(p.split()) for p in shown.split("...")):
        found = printed.find(part, at) if part else at
        assert found >= 0, f"the page shows {shown!r}; the code prints {printed[:600]!r}"
        at = found + len(part)
    print(value)
"""


def pages() -> list[str]:
    found = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return ["README.md", *found]


def blocks(page: str) -> list[tuple[int, str, str | None]]:
    """(line, code, why it is not run or None) of every python block of ``page``."""
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(before)
        out.append((line, textwrap.dedent(m.group(2)), skip.group(1).strip() if skip else None))
    return out


def script(page: str) -> str:
    parts = ["import torch\ntorch.set_num_threads(1)\n" + _SHOWS]
    for line, code, skip in blocks(page):
        if skip is None:
            code = SHOWN.sub(lambda m: f"{m.group(1)}_shows({m.group(2)}, {m.group(3)!r})", code)
            parts.append(f"# ---- {page}, the block at line {line}\n{code}")
    return "\n".join(parts)


RUNNABLE = [p for p in pages() if any(skip is None for _, _, skip in blocks(p))]
FRAMEWORKS = [p for p in RUNNABLE if p.startswith(os.path.join("docs", "frameworks"))]  # (tests/test_docs_frameworks.py)


#: the environment every page runs in (and its fork server starts in)
ENV = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
           TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
           MASTER_ADDR="127.0.0.1", PYTHONWARNINGS="ignore::DeprecationWarning")


def page_server(pages: list[str]):
    """A module fixture: the fork server (tests/page_server.py) of ``pages``, preloaded with torch and
    every module those pages import before they set any environment."""

    @pytest.fixture(scope="module")
    def server():
        preload = ["torch"]
        for page in pages:
            preload += [m for m in page_server_mod.preloadable(page_server_mod.imports(script(page))[0])
                        if m not in preload]
        ours = page_server_mod.Server(preload, ENV)
        yield ours
        ours.close()

    return server


def run_page(page: str, tmp_path, server) -> None:
    """Run the page's blocks in one fresh process (forked from ``server``, where gradhealth was
    never imported), in ``tmp_path`` (their logs and outputs)."""
    path = tmp_path / "page.py"
    text = script(page)
    path.write_text(text, encoding="utf-8")
    env = dict(ENV, MASTER_PORT=str(free_port()))
    code, out, err = server.run([str(path)], cwd=str(tmp_path), env=env, output=str(tmp_path), timeout=240,
                                fresh=page_server_mod.imports(text)[1])
    assert code == 0, f"{page} failed:\n{out[-3000:]}\n{err[-6000:]}"


server = page_server([p for p in RUNNABLE if p not in FRAMEWORKS])


@pytest.mark.slow  # (a page's runs in a process of its own: the README's took 47 s on busy cores)
@pytest.mark.parametrize("page", [p for p in RUNNABLE if p not in FRAMEWORKS])
def test_the_page_runs_as_written(page, tmp_path, server):
    run_page(page, tmp_path, server)


def test_every_page_has_a_recipe_and_each_skip_says_why():
    for page in pages():
        for line, _, skip in blocks(page):
            assert skip is None or len(skip) > 10, f"{page}:{line}: a not-run block must say why"
    frameworks = glob.glob(os.path.join(ROOT, "docs", "frameworks", "*.md"))
    assert len(frameworks) >= 15
    for page in frameworks:
        rel = os.path.relpath(page, ROOT)
        assert rel in RUNNABLE, f"{rel} has no python block that runs"


def test_the_readme_stays_short_and_links_to_pages_that_exist():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\(((?:docs/)[^)#\s]+)", text)
    assert links, "the README links into the manual"
    missing = [t for t in links if not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, f"README links to missing files: {missing}"
    for target, anchor in re.findall(r"\]\((docs/[^)#\s]+)#([^)\s]+)\)", text):
        page = open(os.path.join(ROOT, target), encoding="utf-8").read()
        slugs = {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h.strip().lower())) for h in re.findall(r"^#+ (.*)$", page, re.M)}
        assert anchor in slugs, f"README links to {target}#{anchor}, a heading that page does not have"


def test_every_finding_kind_and_state_has_its_entry_in_the_field_guide():
    """A user who reads a kind in a warning finds it in the field guide, and its level in the README."""
    guide = open(os.path.join(ROOT, "docs", "field-guide.md"), encoding="utf-8").read()
    headings = set(re.findall(r"^#+ .*?`([A-Z_]+)`", guide, re.M))
    headings |= {n for h in re.findall(r"^#+ (.*)$", guide, re.M) for n in re.findall(r"`([A-Z_]+)`", h)}
    missing = [k.name for k in [*gh.FindingKind, *gh.Status] if k.name not in headings]
    assert not missing, f"no heading in docs/field-guide.md for: {missing}"
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    rows = {n for line in readme.splitlines() if line.startswith("| [`") for n in re.findall(r"`([A-Z_]+)`", line.split("|")[1])}
    missing = [k.name for k in gh.FindingKind if k.name not in rows]
    assert not missing, f"FindingKinds without a row in the README's findings table: {missing}"


@pytest.mark.slow  # (a fork server of its own: an interpreter that imports torch)
def test_a_page_runs_in_a_process_of_its_own_where_gradhealth_was_never_imported(tmp_path):
    """tests/page_server.py keeps what ``python page.py`` promised the pages: a fresh ``__main__``, no
    gradhealth imported before the page's own import, a failure's exit code and traceback, and a
    module the page imports after setting its environment not imported before."""
    ours = page_server_mod.Server(["torch", "wave"], ENV)
    try:
        page = tmp_path / "page.py"
        page.write_text("import sys\nprint(__name__, sys.argv[0] == __file__, sys.path[0],\n"
                        "      [m for m in sys.modules if m.startswith('gradhealth')])\n"
                        "import gradhealth\nprint(gradhealth.__name__)\n", encoding="utf-8")
        code, out, err = ours.run([str(page)], cwd=str(tmp_path), env=ENV, output=str(tmp_path), timeout=120)
        assert code == 0 and out.split("\n")[:2] == [f"__main__ True {tmp_path} []", "gradhealth"], (out, err)
        page.write_text("raise ValueError('the page failed')\n", encoding="utf-8")
        code, out, err = ours.run([str(page)], cwd=str(tmp_path), env=ENV, output=str(tmp_path), timeout=120)
        assert code == 1 and "ValueError: the page failed" in err and "Traceback" in err
        code, out, err = ours.run([str(page)], cwd=str(tmp_path), env=ENV, output=str(tmp_path), timeout=120,
                                  fresh=["wave"])  # (as if the page set its environment before `import wave`)
        assert code == 3 and "['wave'] were imported before the page set its environment" in err
        code, out, err = ours.run(["-m", "gradhealth", "--version"], cwd=str(tmp_path), env=ENV,
                                  output=str(tmp_path), timeout=120)
        assert code == 0 and out.startswith("gradhealth "), (out, err)
    finally:
        ours.close()
