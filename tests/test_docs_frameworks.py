"""The manual's framework pages (docs/frameworks/): each page's python blocks run in order, in one
fresh interpreter, as written (a file of its own so that ``pytest -n 2 --dist loadfile`` runs them
beside the other pages of tests/test_docs.py). Each page holds a healthy run, silent under
``on_problem="raise"``, and a planted bug it asserts is named."""

import pytest

from test_docs import FRAMEWORKS, run_page


@pytest.mark.slow  # (a framework's real run in a fresh interpreter: 50-75 s a page on busy cores)
@pytest.mark.parametrize("page", FRAMEWORKS)
def test_the_framework_page_runs_as_written(page, tmp_path):
    run_page(page, tmp_path)
