"""The bucket min/max decimation: which points of a series to keep so that at most n remain and
no spike disappears. Pure (numpy only); every decimation in gpu_lab uses it: the registry's levels
when it reads, the readers' bounded history, the plots and the server's series."""
from __future__ import annotations

from typing import Any, Sequence


def minmax_indices(y: Sequence[float], n: int) -> Any:
    """Which of the points y[0..m-1] to keep so that at most n remain: the first and the last, and
    each bucket's minimum and maximum in order (so a loss spike stays visible). A numpy index array;
    every decimation in gpu_lab (history, plots, the server's series) uses this one."""
    import numpy as np

    if n < 4:
        raise ValueError(f"decimate: n must be >= 4, got {n}")
    m = len(y)
    if m <= n:
        return np.arange(m)
    vals_all = np.asarray(y, dtype=float)
    buckets = (n - 2) // 2
    inner = m - 2
    lo = 1 + (np.arange(buckets) * inner) // buckets
    hi = 1 + (np.arange(1, buckets + 1) * inner) // buckets
    width = int((hi - lo).max())
    pos = lo[:, None] + np.arange(width)[None, :]  # bucket b's indices, padded to equal width
    valid = pos < hi[:, None]
    vals = vals_all[np.minimum(pos, m - 1)]
    # argmin/argmax return the first occurrence, as min()/max() do; padding never wins
    imin = np.take_along_axis(pos, np.argmin(np.where(valid, vals, np.inf), 1)[:, None], 1)
    imax = np.take_along_axis(pos, np.argmax(np.where(valid, vals, -np.inf), 1)[:, None], 1)
    nonempty = hi > lo
    a, b = imin[nonempty, 0], imax[nonempty, 0]
    # buckets are disjoint and in order: each one's two indices, smaller first, are already sorted
    pair = np.stack((np.minimum(a, b), np.maximum(a, b)), axis=1)
    keep = pair.ravel()[np.stack((np.ones(len(a), bool), a != b), axis=1).ravel()]
    return np.concatenate(([0], keep, [m - 1]))


def decimate_minmax(x: Sequence[float], y: Sequence[float], n: int) -> tuple[list, list]:
    """(x, y) reduced to at most n points by `minmax_indices`, as lists."""
    if len(x) != len(y):
        raise ValueError(f"decimate_minmax: x has {len(x)} points but y has {len(y)}")
    idx = minmax_indices(y, n).tolist()
    return [x[i] for i in idx], [y[i] for i in idx]


__all__ = ["minmax_indices", "decimate_minmax"]
