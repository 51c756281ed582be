"""``gradhealth demo``: planted bugs on synthetic data and what gradhealth says about each.

``plain`` is the plain PyTorch loop (torch only), ``lightning_fit`` the same scenarios as
``Trainer.fit`` runs (its module and data in ``lightning_parts``), ``hf_trainer`` a tiny BERT
through Hugging Face ``Trainer``. Nothing in the library imports these.
"""
