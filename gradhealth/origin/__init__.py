"""Where a NaN came from: the module in forward and in backward, and the autograd operation
(:mod:`.trace`, :mod:`.opwatch`); the loop's calls kept to replay the failing step (:mod:`.calls`,
:mod:`.replay`); what a re-run restores (:mod:`.snapshot`).

Imports: ``base``, ``model``, ``measure``.
"""
