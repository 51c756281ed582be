"""One verdict on every rank under torch.distributed: a rank's observation packed and reduced with one
collective (:mod:`.crossrank`), the ranks at the same check (:mod:`.lockstep`), replicas whose values or
gradients differ (:mod:`.replicas`), and the DDP wrapper as a check sees it (:mod:`.ddp`).

Imports: ``base``, ``model``, ``measure``.
"""
