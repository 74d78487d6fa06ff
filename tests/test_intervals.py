"""intervals.py against known cases: Wilson's published values, the normal limit of the paired bootstrap."""
import math

import pytest

from intervals import paired_difference, success_interval, wilson


def test_wilson_matches_the_published_interval():
    # Wilson (1927) / Newcombe (1998) table: 8 of 10 -> [0.490, 0.943]; 0 of 10 -> [0, 0.278]
    assert wilson(8, 10) == pytest.approx((0.4902, 0.9433), abs=5e-4)
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=5e-4)
    assert wilson(10, 10)[1] == pytest.approx(1.0) and wilson(10, 10)[0] == pytest.approx(0.7225, abs=5e-4)
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_binary_single_trial_rates_use_wilson_and_others_the_bootstrap():
    rate = success_interval({f"t{i}": [float(i < 8)] for i in range(10)})
    assert rate.method == "wilson" and rate.tasks == 10 and rate.mean == 0.8
    assert (rate.lo, rate.hi) == pytest.approx(wilson(8, 10))
    assert str(rate) == "0.800 [0.490, 0.943] (n=10)"
    # 200 tasks, two trials each: the interval is over tasks and near the normal one for the task means
    per_task = {f"t{i}": [float(i % 3 == 0), float(i % 2 == 0)] for i in range(200)}
    rate = success_interval(per_task)
    means = [sum(v) / 2 for v in per_task.values()]
    mu = sum(means) / len(means)
    se = math.sqrt(sum((m - mu) ** 2 for m in means) / (len(means) - 1) / len(means))
    assert rate.method == "bootstrap" and rate.tasks == 200
    assert rate.lo == pytest.approx(mu - 1.96 * se, abs=0.01) and rate.hi == pytest.approx(mu + 1.96 * se, abs=0.01)
    assert success_interval(per_task) == rate                      # seeded: the same every time


def test_the_paired_difference_matches_its_normal_limit_and_is_narrower_than_unpaired():
    # 100 tasks: 30 better, 10 worse, 60 the same -> d in {1, -1, 0}: mean 0.2, var 0.36, se 0.06
    a, b = {}, {}
    for i in range(100):
        a[i], b[i] = ([1.0], [0.0]) if i < 30 else ([0.0], [1.0]) if i < 40 else ([float(i % 2)], [float(i % 2)])
    d = paired_difference(a, b)
    assert (d.diff, d.tasks, d.better, d.worse, d.same) == (pytest.approx(0.2), 100, 30, 10, 60)
    assert d.lo == pytest.approx(0.2 - 1.96 * 0.06, abs=0.015) and d.hi == pytest.approx(0.2 + 1.96 * 0.06, abs=0.015)
    assert d.resolved and "no difference" not in str(d)
    ra, rb = success_interval(a), success_interval(b)
    unpaired_half = 1.96 * math.sqrt(ra.mean * (1 - ra.mean) / 100 + rb.mean * (1 - rb.mean) / 100)
    assert (d.hi - d.lo) / 2 < unpaired_half                    # pairing removes the shared task variance


def test_a_difference_inside_its_interval_is_no_difference():
    same = {i: [float(i % 3 == 0)] for i in range(50)}
    d = paired_difference(same, dict(same))
    assert (d.diff, d.lo, d.hi) == (0.0, 0.0, 0.0) and not d.resolved and str(d).endswith("no difference")
    flip = {i: [1.0 - v[0]] if i in (0, 1) else v for i, v in same.items()}   # one better, one worse
    d = paired_difference(flip, same)
    assert d.better == 1 and d.worse == 1 and d.lo < 0 < d.hi and not d.resolved


def test_only_shared_tasks_are_paired_and_nothing_shared_is_an_error():
    d = paired_difference({"x": [1.0], "y": [1.0]}, {"y": [0.0], "z": [0.0]})
    assert d.tasks == 1 and d.diff == 1.0
    with pytest.raises(ValueError, match="share no task"):
        paired_difference({"x": [1.0]}, {"z": [0.0]})
    with pytest.raises(ValueError):
        success_interval({})
