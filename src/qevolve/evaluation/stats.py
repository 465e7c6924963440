"""Estimators of ``qevolve compare`` over seed replicates (runs of one protocol with different seeds).

The estimators, each defined next to its code:

- :func:`seed_mean` -- the mean of the seeds' values, every seed weighted equally.
- :func:`interquartile_mean` -- IQM, the mean of the middle 50% of the seed values (rliable's
  aggregate, trimmed as ``scipy.stats.trim_mean(x, 0.25)``).
- :func:`probability_of_improvement` -- P(X > Y): the probability that a random run of X beats a
  random run of Y (rliable's definition), the Mann-Whitney statistic per task averaged over tasks.
- :func:`two_level_means` with :func:`draw_seeds` -- the two-level bootstrap: resample seeds, then
  goals within each resampled seed; :func:`percentile_interval` turns its draws into a 95% interval.

The single-run paired bootstrap over episodes is :func:`qevolve.evaluation.compare.paired_bootstrap`.
Everything random takes a ``np.random.Generator`` (``np.random.default_rng(seed)``), so a table is
reproducible from its seed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["seed_mean", "interquartile_mean", "improvement_probability", "probability_of_improvement",
           "draw_seeds", "two_level_means", "percentile_interval", "IQM_MIN_SEEDS"]

#: IQM is reported from this many seeds on: with fewer, trimming 25% from each end drops at most one
#: seed per side (or none), and the IQM says little beyond the mean.
IQM_MIN_SEEDS = 5

# Bound on the elements of one chunk of bootstrap draws (resamples x seeds x goals x columns): the
# memory of a draw stays ~16 MB whatever the number of resamples.
_CHUNK_ELEMENTS = 2_000_000


def seed_mean(values: Sequence[float] | np.ndarray, axis: int = -1) -> np.ndarray | float:
    """mean = (1/n) sum_i v_i over the n seeds: each seed counts once, whatever its episode count."""
    return np.asarray(values, dtype=np.float64).mean(axis=axis)


def interquartile_mean(values: Sequence[float] | np.ndarray, axis: int = -1) -> np.ndarray | float:
    """IQM = mean of v_(k+1) .. v_(n-k) of the sorted values, k = floor(0.25 n).

    rliable's interquartile mean, trimmed as ``scipy.stats.trim_mean(v, proportiontocut=0.25)``:
    floor(0.25 n) values are cut from each end, whole values only (5 seeds: the middle 3; 8: the
    middle 4). Robust to one outlying seed, less noisy than the median."""
    v = np.sort(np.asarray(values, dtype=np.float64), axis=axis)
    n = v.shape[axis]
    if n == 0:
        raise ValueError("interquartile mean of no values")
    cut = int(0.25 * n)
    return np.take(v, np.arange(cut, n - cut), axis=axis).mean(axis=axis)


def improvement_probability(x: np.ndarray, y: np.ndarray) -> np.ndarray | float:
    """P(X > Y) on one task: (1 / (n m)) sum_i sum_j S(x_i, y_j), S = 1 if x_i > y_j, 1/2 if equal, else 0.

    The Mann-Whitney U statistic of the n runs of X against the m runs of Y, divided by n m. Leading
    axes are batch axes (e.g. bootstrap resamples): ``x`` (..., n) and ``y`` (..., m) give (...)."""
    x = np.asarray(x, dtype=np.float64)[..., :, None]
    y = np.asarray(y, dtype=np.float64)[..., None, :]
    score = (x > y) + 0.5 * (x == y)
    return score.mean(axis=(-2, -1))


def probability_of_improvement(x_tasks: Sequence[np.ndarray], y_tasks: Sequence[np.ndarray]) -> np.ndarray | float:
    """P(X > Y) = (1/M) sum_m P(X_m > Y_m) over the M tasks (rliable's probability of improvement).

    ``x_tasks[m]`` holds the runs (here: seeds) of X on task m (here: a split), ``y_tasks[m]`` those of
    Y; the runs of one task need not be as many for X as for Y. Batch axes as in
    :func:`improvement_probability`."""
    if len(x_tasks) != len(y_tasks) or not x_tasks:
        raise ValueError("probability of improvement: one array of runs per task for X and for Y")
    return np.mean([improvement_probability(x, y) for x, y in zip(x_tasks, y_tasks)], axis=0)


def draw_seeds(rng: np.random.Generator, n_seeds: int, resamples: int) -> np.ndarray:
    """The first level of the two-level bootstrap: (resamples, n_seeds) seed indices, with replacement.

    Drawn on their own, before any goal, so that callers can share one seed draw between the
    methods and splits of the same runs (a resampled seed is a whole run: all its methods, all its
    splits)."""
    return rng.integers(0, n_seeds, size=(resamples, n_seeds))


def two_level_means(seeds: Sequence[np.ndarray], seed_draws: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The second level: for each resample r and slot j, the drawn seed s = ``seed_draws[r, j]``, its
    n_s goals resampled with replacement, and the mean of each column over them.

    ``seeds[s]`` is an (n_s, k) array: one row per goal of seed s, k aligned columns (e.g. the
    method's and the baseline's outcome on that goal, so that the same resampled goals serve both:
    a paired difference). Returns (resamples, n_seeds, k).

    Goal g of a slot is ``floor(u * n_s)`` with u ~ U[0, 1) from ``rng.random`` of shape
    (resamples, n_seeds, max_s n_s), drawn chunk by chunk in that order (the same stream as one draw
    of the whole array), of which the first n_s of each slot are used: a plain loop over (r, j) on
    the same u reproduces this exactly (see the tests)."""
    arrays = [np.asarray(a, dtype=np.float64).reshape(len(a), -1) for a in seeds]
    sizes = np.array([len(a) for a in arrays])
    if len(arrays) == 0 or (sizes == 0).any():
        raise ValueError("two-level bootstrap: every seed needs at least one goal")
    k = arrays[0].shape[1]
    width = int(sizes.max())
    padded = np.zeros((len(arrays), width, k))
    for s, a in enumerate(arrays):
        padded[s, :len(a)] = a
    resamples, n_slots = seed_draws.shape
    out = np.empty((resamples, n_slots, k))
    chunk = max(1, _CHUNK_ELEMENTS // (n_slots * width * k))
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        drawn = seed_draws[start:stop]  # (c, S)
        n = sizes[drawn][..., None]  # (c, S, 1): goals of each slot's seed
        goals = np.minimum((rng.random((stop - start, n_slots, width)) * n).astype(np.intp), n - 1)
        used = np.arange(width) < n  # only the first n_s draws of a slot count
        values = padded[drawn[..., None], goals]  # (c, S, width, k)
        out[start:stop] = (values * used[..., None]).sum(axis=2) / n
    return out


def percentile_interval(draws: np.ndarray, axis: int = 0) -> tuple[float, float]:
    """The 95% percentile interval: the 2.5th and 97.5th percentiles of the bootstrap draws."""
    low, high = np.percentile(draws, [2.5, 97.5], axis=axis)
    return float(low), float(high)
