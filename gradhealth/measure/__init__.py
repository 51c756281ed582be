"""Measuring on the device: the exact norm of every gradient in a constant number of kernels and one
transfer (:mod:`.stats`, packed by :mod:`.layout`, read as an :class:`.observe.Observation`), the
optimizer step's changes and update norms through its step hooks (:mod:`.deltas`, :mod:`.rules`,
:mod:`.compare`, what the tracker saves: :mod:`.tracker_state`), the learning rates (:mod:`.lrstory`), the
gradients a step consumed or ran on (:mod:`.stale`, :mod:`.ranon`), the stacked experts' slices
(:mod:`.expert_norms`), one step's numbers (:mod:`.steps`), and an accumulation window's micro-batches
(:mod:`.window`). Numbers and records, no verdict.

A new number a check reads from the device goes here. Imports: ``base``, ``model``.
"""
