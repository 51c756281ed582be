"""The manual's framework pages (docs/frameworks/): each page's python blocks run in order, in one
fresh interpreter, as written (a file of its own so that ``pytest -n 2 --dist loadfile`` runs them
beside the other pages of tests/test_docs.py). Each page holds a healthy run, silent under
``on_problem="raise"``, and a planted bug it asserts is named."""

import pytest

from test_docs import FRAMEWORKS, page_server, run_page

server = page_server(FRAMEWORKS)  # (torch and the frameworks imported once, each page forked from it)


@pytest.mark.slow  # (a framework's real run in a process of its own: 5-25 s a page on busy cores)
@pytest.mark.parametrize("page", FRAMEWORKS)
def test_the_framework_page_runs_as_written(page, tmp_path, server):
    run_page(page, tmp_path, server)
