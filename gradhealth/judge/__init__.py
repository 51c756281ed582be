"""Judging: from what a check observed to the parameter states and the findings. :mod:`.classify` is the
six-state decision tree; :func:`.verdict.judge` runs a check's judges in order; :mod:`.judges` holds the
pure ones, and each story judged against the run's own past has its module (:mod:`.history`,
:mod:`.patience`, :mod:`.pileup`, :mod:`.fitted`, :mod:`.underflow`, ...). The loss-side guards and the
forward watch they rest on are :mod:`.guards`; an accumulation window's micro-batches, :mod:`.micro_batches`.

A new judge is a function in :mod:`.judges` (or a module here) and one line in ``verdict.judge``; one that
can speak on a check whose gradients are all healthy also makes :func:`gradhealth.check.steady.ready` decline
(the steady fast path skips the judges when nothing but healthy numbers was seen).
Imports: ``base``, ``model``, ``measure``, ``ranks``, ``origin``.
"""
