"""A test module's long-lived objects out of the garbage collector's full collections.

Every ``transformers.Trainer.train()`` starts with a full collection (Accelerate's ``free_memory``),
and ``GradHealthCallback`` finds its Trainer among the referrers of its callback list (five
``gc.get_referrers`` scans of every tracked object). In a test process holding torch, transformers,
Lightning and pytest, that is half a million objects: 0.4 s for the collection and 0.35 s for the
scans on an idle core, half of test_fitted's 192-step Trainer run (0.95 s of CPU, 0.45 s frozen).
``frozen_heap`` (module scope) collects once, then freezes what exists
(``gc.freeze``: the objects of the imports and of the modules run before, none of them a Trainer or
callback of this module's runs) and thaws it after the module's last test: the runs, their
collections and the referrer scans are the same on the objects the tests make, but skip the
frozen ones."""

import gc

import pytest


@pytest.fixture(scope="module")
def frozen_heap():
    gc.collect()  # (garbage is collected, not frozen)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
