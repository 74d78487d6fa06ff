"""95% intervals for success rates and paired differences: the one place every report takes them from.

    rate = success_interval({"t1": [1.0], "t2": [0.0], ...})      # per task: its trials' rewards
    diff = paired_difference(per_task_b1, per_task_b0)             # the same tasks (and seeds) in both

A task is the unit of resampling: its trials share the task, so they are averaged first and the interval is
over tasks. Binary outcomes with one trial per task get the Wilson score interval (exact coverage is close to
95% even at 0 or n successes, where the normal interval collapses); anything else (several trials, partial
rewards) a percentile bootstrap over tasks. A paired difference resamples the same tasks in both arms at once
(paired bootstrap), so the task-to-task variance that both arms share cancels; it also counts the tasks that
got better, worse or stayed the same. Bootstraps are seeded: the same inputs give the same interval.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054           # the normal quantile of 0.975
BOOTSTRAP_SAMPLES = 10_000


@dataclass(frozen=True)
class Rate:
    """A success rate over `tasks` tasks with its 95% interval [lo, hi] and how it was computed."""
    mean: float
    lo: float
    hi: float
    tasks: int
    method: str                       # "wilson" or "bootstrap"

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.lo:.3f}, {self.hi:.3f}] (n={self.tasks})"


@dataclass(frozen=True)
class Difference:
    """mean(a) - mean(b) over the tasks both have, its paired 95% interval, and per-task better/worse counts."""
    diff: float
    lo: float
    hi: float
    tasks: int
    better: int                       # tasks where a's mean reward is higher than b's
    worse: int
    same: int

    @property
    def resolved(self) -> bool:
        """True when the interval excludes 0: a difference; otherwise it is reported as none."""
        return self.lo > 0 or self.hi < 0

    def __str__(self) -> str:
        return (f"{self.diff:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}] (n={self.tasks}, {self.better} better, "
                f"{self.worse} worse){'' if self.resolved else ' no difference'}")


def per_task_rewards(records: list[dict]) -> dict:
    """task id -> its trials' rewards in trial order, from evaluate.py's JSONL records."""
    out: dict = {}
    for r in sorted(records, key=lambda r: r.get("trial", 0)):
        out.setdefault(r["task_id"], []).append(float(r["reward"]))
    return out


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion successes / n."""
    if n <= 0:
        raise ValueError("wilson needs n >= 1")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _task_means(per_task: dict) -> dict:
    """task -> mean of its trials' rewards (a bare number counts as one trial)."""
    out = {}
    for task, rewards in per_task.items():
        values = [float(r) for r in (rewards if isinstance(rewards, (list, tuple)) else [rewards])]
        if not values:
            raise ValueError(f"task {task!r} has no rewards")
        out[task] = sum(values) / len(values)
    return out


def _percentile_interval(samples: np.ndarray) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [0.025, 0.975])
    return float(lo), float(hi)


def _bootstrap_index(n: int, samples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(samples, n))


def success_interval(per_task: dict, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> Rate:
    """Mean success over tasks with its 95% interval. per_task: task id -> reward or list of trial rewards."""
    if not per_task:
        raise ValueError("no tasks to put an interval on")
    single_binary = all(not isinstance(r, (list, tuple)) or len(r) == 1 for r in per_task.values())
    means = np.array(list(_task_means(per_task).values()))
    n = len(means)
    if single_binary and np.all((means == 0) | (means == 1)):
        lo, hi = wilson(int(means.sum()), n)
        return Rate(float(means.mean()), lo, hi, n, "wilson")
    boot = means[_bootstrap_index(n, samples, seed)].mean(axis=1)
    lo, hi = _percentile_interval(boot)
    return Rate(float(means.mean()), lo, hi, n, "bootstrap")


def paired_difference(a: dict, b: dict, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> Difference:
    """mean(a) - mean(b) on the tasks both hold, with a paired-bootstrap 95% interval (tasks resampled together).
    a, b: task id -> reward or list of trial rewards (trials paired by position: the same seeds)."""
    common = [t for t in a if t in b]
    if not common:
        raise ValueError("the two runs share no task: nothing to pair")
    ma, mb = _task_means({t: a[t] for t in common}), _task_means({t: b[t] for t in common})
    d = np.array([ma[t] - mb[t] for t in common])
    boot = d[_bootstrap_index(len(d), samples, seed)].mean(axis=1)
    lo, hi = _percentile_interval(boot)
    return Difference(float(d.mean()), lo, hi, len(d), int((d > 0).sum()), int((d < 0).sum()), int((d == 0).sum()))


def mean_interval(values, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(mean, lo, hi) of independent values (e.g. one number per seed) by a percentile bootstrap."""
    x = np.array([float(v) for v in values])
    if x.size == 0:
        raise ValueError("no values")
    boot = x[_bootstrap_index(x.size, samples, seed)].mean(axis=1)
    lo, hi = _percentile_interval(boot)
    return float(x.mean()), lo, hi
