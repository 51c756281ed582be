"""What the README and the manual show as output is what the code prints: each shown text, read with
``...`` standing for what it leaves out, is found in what the same run prints."""

import os
import re
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import gradhealth as gh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(page: str) -> str:
    return open(os.path.join(ROOT, page), encoding="utf-8").read()


def shows(shown: str, printed: str) -> bool:
    """``shown``'s words, with ``...`` for anything, appear in ``printed`` in that order."""
    printed = " ".join(printed.split())
    at = 0
    for part in (" ".join(p.split()) for p in shown.split("...")):
        if not part:
            continue
        found = printed.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


def warnings_of(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]


def head_left_out(on_problem="warn") -> list[str]:
    """The README's and getting-started's stand-in model with its last layer out of the optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.05)
    x = torch.randn(16, 8)

    def run():
        with gh.GradHealth(model, optimizer, on_problem=on_problem) as monitor:
            nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            monitor.check()
    if on_problem == "raise":
        with pytest.raises(gh.GradHealthError) as caught:
            run()
        return [str(caught.value)]
    return warnings_of(run)


def test_the_matcher_reads_the_ellipsis_as_anything():
    assert shows("a b ... d", "a  b c\n d e") and shows("... c", "a b c")
    assert not shows("a ... b", "b a") and not shows("a x", "a b")


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_warning_shown_after_the_plain_loop_is_the_one_it_prints(page):
    text = read(page)
    after = text.split("A problem gives a `gh.GradHealthWarning`", 1)[1]
    shown = re.search(r"^```\n(.*?)^```", after, re.S | re.M).group(1)
    assert "NOT_IN_OPTIMIZER" in shown  # the premise: that block
    [printed] = head_left_out()
    assert shows(shown, printed), f"{page} shows:\n{shown}\nthe code prints:\n{printed}"


def test_the_raised_error_shown_in_getting_started_is_the_one_it_raises():
    text = read("docs/getting-started.md")
    shown = re.search(r"print\(e\) +# (gradhealth step .*)$", text, re.M).group(1)
    [raised] = head_left_out("raise")
    assert shows(shown, raised), f"shown: {shown}\nraised: {raised}"


def test_said_once_examples_are_what_a_head_left_out_for_200_steps_prints():
    """getting-started's "Said once": the reminder at the 100th check and the word when it clears."""
    text = read("docs/getting-started.md")
    quoted = re.findall(r"`(gradhealth step \d+: (?:resolved|still)[^`]*)`", " ".join(text.split()))
    assert len(quoted) == 2, quoted
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(body=nn.Linear(8, 32), act=nn.ReLU(), head=nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.body.parameters(), lr=0.05)

    def run():
        with gh.GradHealth(model, optimizer) as monitor:
            for step in range(300):
                if step == 200:  # the fix, at step 200
                    optimizer.add_param_group({"params": list(model.head.parameters())})
                optimizer.zero_grad()
                model(torch.randn(4, 8)).square().mean().backward()
                monitor.check()
                optimizer.step()
    said = warnings_of(run)
    assert len([s for s in said if "resolved" not in s]) == 3  # "warns 3 times in 300 steps, not 300"
    for q in quoted:
        assert any(shows(q, s) for s in said), f"shown: {q}\nsaid:\n" + "\n".join(s[:160] for s in said)


# ------------------------------------------------- a block copied alone runs alone
def unbound(code: str) -> set[str]:
    """Names a block reads that it neither imports, defines nor assigns, and Python does not have."""
    import ast
    import builtins

    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def test_each_readme_block_stands_alone():
    """The README's blocks are copied one at a time (the fastai one failed alone: NameError: torch)."""
    from test_docs import blocks

    found = blocks("README.md")
    assert len(found) >= 4 and any("fastai" in code for _, code, _ in found)  # the premise
    assert unbound("x = torch.ones(1)\nimport os\nos.getcwd(y)") == {"torch", "y"}  # the check itself
    wrong = {line: sorted(unbound(code)) for line, code, _ in found if unbound(code)}
    assert not wrong, f"README blocks (by line) that use names they do not import or define: {wrong}"


# ---------------------------------------------------------- the dashboards' tags
def test_every_tag_a_run_writes_is_in_the_dashboards_table(tmp_path):
    """dashboards.md said "tags follow the keys above" with no keys above: its table now, against
    the tags a run with problems, update norms, valid counts, the step guard and a clip writes."""
    from gradhealth.integrations.tensorboard import TensorBoardSink, read_run

    text = read("docs/dashboards.md")
    keys = {k for row in re.findall(r"^\| (`gradhealth/.*?) \|", text, re.M) for k in re.findall(r"`(gradhealth/[^`]+)`", row)}
    pattern = re.compile("|".join(re.sub(r"<[^>]+>", ".+", re.escape(k)) for k in sorted(keys)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)  # a head left out: findings and states
    sink = TensorBoardSink(tmp_path, every_n=1)
    with gh.GradHealth(model, optimizer, sinks=[sink], on_problem="ignore", update_every=1, skip_nonfinite=True) as monitor:
        for step in range(4):
            x = torch.randn(8, 4)
            if step == 2:
                x[0, 0] = float("nan")
            monitor.track_valid(x[:, 0] > 0, "positive")
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            monitor.check(loss=loss)
            monitor.clip_grad_norm_(1.0)
            optimizer.step()
    tags = set(read_run(tmp_path, text=True).tag)
    for expected in ("gradhealth/update_norm/total", "gradhealth/valid/positive", "gradhealth/skipped",
                     "gradhealth/clip_coef", "gradhealth/findings_text", "gradhealth/status/NOT_IN_OPTIMIZER"):
        assert expected in tags, (expected, sorted(tags))  # the premise: the run wrote each kind
    missing = sorted(t for t in tags if not pattern.fullmatch(t))
    assert not missing, f"tags the run wrote that dashboards.md does not list: {missing}"


def test_no_two_field_guide_entries_say_the_same():
    """UNEXPECTED_FROZEN's and UNEXPECTED_TRAINABLE's entries were word for word the same."""
    guide = read("docs/field-guide.md")
    entries = {}
    for part in re.split(r"^### ", guide, flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        if "**What it means**" in body:
            entries[heading.strip()] = " ".join(body.split("\n### ")[0].split())
    assert len(entries) >= 30  # the premise: the entries were found
    seen = {}
    for heading, body in entries.items():
        assert body not in seen, f"{heading} and {seen.get(body)} say the same"
        seen[body] = heading
