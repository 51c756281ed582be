"""The model view: which parameters a check judges and by which names (``fc1.weight`` under any
wrapper), which optimizers hold them (wrapped, not torch's, or training through master copies), where
each gradient lives (``.grad``, or a buffer a framework keeps), the stacked experts, and the facts of
the model's code a judge needs (which modules read ``training``, activation checkpointing). Nothing here
reads a tensor's values.

A new wrapper's rule goes in :mod:`.wrappers`; a framework's gradient location in :mod:`.gradients`; an
optimizer wrapper in :mod:`.optimizers`. Imports: ``base``.
"""
