"""Judging: from what a check observed to the parameter states and the findings. :mod:`.classify` is the
six-state decision tree; :func:`.verdict.judge` runs a check's judges in order; :mod:`.judges` holds the
pure ones, and each story judged against the run's own past has its module (:mod:`.history`,
:mod:`.patience`, :mod:`.pileup`, :mod:`.fitted`, :mod:`.underflow`, ...).

A new judge is a function in :mod:`.judges` (or a module here) and one line in ``verdict.judge``.
Imports: ``base``, ``model``, ``measure``, ``ranks``, ``origin``.
"""
