"""Spearman's rank correlation, ties given their mean rank (no SciPy needed by the benchmarks)."""

from typing import List, Sequence

__all__ = ["ranks", "spearman"]


def ranks(values: Sequence[float]) -> List[float]:
    """Each value's rank from 1, tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """The Pearson correlation of ``a``'s and ``b``'s ranks (1: the same order; nan: fewer than 2)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} values against {len(b)}")
    if len(a) < 2:
        return float("nan")
    x, y = ranks(a), ranks(b)
    mx, my = sum(x) / len(x), sum(y) / len(y)
    cov = sum((p - mx) * (q - my) for p, q in zip(x, y))
    vx = sum((p - mx) ** 2 for p in x) ** 0.5
    vy = sum((q - my) ** 2 for q in y) ** 0.5
    return cov / (vx * vy) if vx and vy else float("nan")
