"""``gradhealth bench``: what the monitor costs, timed side by side with the naive way in one run.

``core`` is the entry point and the core sections; the others are the sections that need their
own setting (stacked experts, many tensors, the whole training step, Lightning, Trainer, the
TensorBoard sink). Nothing in the library imports these.
"""
