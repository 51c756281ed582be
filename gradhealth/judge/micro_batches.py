"""What happened inside an accumulation window, judged at the check that ends it: from every rank's row of
the window (:mod:`gradhealth.measure.window` keeps them), a micro-batch whose loss was non-finite and one whose
valid mask selected nothing, each named with its rank, where the gradients of the whole window only show
NON_FINITE_GRAD."""

from __future__ import annotations

from ..base.findings import Finding, FindingKind

__all__ = ["findings"]


def findings(rows: list[list[float]], names: list[str], step: int, grads_finite: bool, ranked: bool) -> list[Finding]:
    """What happened inside the accumulation window a check ends, from every rank's row (one row,
    ``ranked`` False, on one process): NON_FINITE_LOSS for a micro-batch whose loss was
    non-finite, EMPTY_VALID_SET for one whose valid mask selected nothing (with the NaN loss it made,
    one finding: the emptiness is its cause), each naming the micro-batch and the rank. An empty
    micro-batch whose loss was not seen non-finite, in a window whose gradients are finite (a guarded
    mean), added nothing to them: said, not taken as an error."""
    bad: dict[int, tuple[int, int, float]] = {}  # rank -> (micro-batch, micro-batches, loss)
    empty: dict[str, dict[int, tuple[int, int]]] = {}  # name -> rank -> (micro-batch, micro-batches)
    made: dict[str, float] = {}  # name -> the non-finite loss an empty micro-batch of it made
    for r, row in enumerate(rows):
        n, k, v = int(row[0]), int(row[1]), row[2]
        for j, name in enumerate(names):
            e = int(row[3 + j])
            if e >= 0:
                empty.setdefault(name, {})[r] = (e, n)
                if e == int(row[1]):  # (its NaN loss: said with the emptiness that made it)
                    k, made[name] = -1, v
        if k >= 0:
            bad[r] = (k, n, v)

    def at(where: dict) -> str:
        return " in " + ", ".join(f"micro-batch {k + 1} of {n}{f' on rank {r}' if ranked else ''}"
                                  for r, (k, n, *_) in sorted(where.items()))

    def data(where: dict) -> dict:
        return {"ranks": sorted(where) if ranked else None, "micro_batches": {r: w[0] for r, w in where.items()},
                "window": max(w[1] for w in where.values())}

    found = []
    if bad:
        values = sorted({str(v) for _, _, v in bad.values()})
        found.append(Finding(
            FindingKind.NON_FINITE_LOSS, f"the loss was {' / '.join(values)}{at(bad)} of the accumulation window that "
            f"ends at step {step} (that micro-batch's check() waited for the window's end, where its gradients are "
            "summed with the others'): check the inputs and targets of that batch, a log or division inside the loss, "
            "or a mean over an empty mask (monitor.track_valid(mask) counts it; gh.masked_mean makes the empty case "
            "explicit)", step=step, data={**data(bad), "value": next(iter(bad.values()))[2]}))
    for name, where in empty.items():
        loss = f"its loss was {made[name]}" if name in made else "a mean over it is NaN (or 0 with a guarded mean)"
        found.append(Finding(
            FindingKind.EMPTY_VALID_SET, f"the valid mask {name!r} selected nothing{at(where)} of the accumulation "
            f"window that ends at step {step}: {loss}, and that micro-batch's gradients are summed into the window's; "
            "skip such batches or use gh.masked_mean(..., empty='zero')", step=step,
            data={**data(where), "name": name, "value": made.get(name)},
            against="its loss was not non-finite and the window's gradients are finite: a guarded mean, that "
                    "micro-batch added nothing to them" if grads_finite and name not in made else ""))
    return found
