"""The ``gradhealth`` command's help: what a person reads before running anything."""

import re

import pytest

from gradhealth.cli import main

BENCH_SECTIONS = ["step", "small", "counts", "checks", "budget", "deltas", "experts", "many", "tracer",
                  "distributed", "lightning", "transformers", "tensorboard"]


def help_of(capsys, *argv) -> str:
    try:
        assert main([*argv, "--help"] if argv else ["--help"]) == 0
    except SystemExit as exc:  # (argparse's --help)
        assert exc.code == 0
    return capsys.readouterr().out


def test_the_top_level_help_names_every_option_of_the_demo(capsys):
    demo = help_of(capsys, "demo")
    options = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", demo)) - {"--help"}
    assert {"--steps", "--logdir", "--only", "--progress", "--plain", "--transformers"} <= options  # the premise
    top = help_of(capsys)
    missing = [o for o in sorted(options) if not re.search(rf"(?<![\w-]){o}(?![\w-])", top)]
    assert not missing, f"gradhealth --help leaves out the demo's {missing}:\n{top}"
    assert "--sections" in top and "--format" in top and "--version" in top


@pytest.mark.parametrize("columns", ["60", "80", "100"])
def test_bench_help_keeps_each_section_name_whole(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    text = help_of(capsys, "bench")
    assert "--sections" in text  # the premise
    broken = [s for s in BENCH_SECTIONS if not re.search(rf"(?<![\w-]){s}(?![\w-])", text)]
    assert not broken, f"section names cut by the wrapping: {broken}\n{text}"
