"""Every benchmark module follows bench.Benchmark, and its optional capabilities are the ones bench.OPTIONAL
names (found with bench.optional, never by probing names ad hoc)."""
import inspect

import pytest

import bench
from bench import BENCHES, OPTIONAL, load_bench, optional

REQUIRED = [name for name, _ in inspect.getmembers(bench.Benchmark, inspect.isfunction)
            if not name.startswith("_")] + ["NAME"]
# what each module offers, as bench/__init__.py's table documents it
OFFERS = {"toyworld": {"checklist", "reference_calls", "world_examples", "LOOKUP_TOOLS"},
          "bfcl": {"checklist", "reference_calls", "ground_truth_trajectory"},
          "tau2": {"checklist", "ground_truth_trajectory", "pass_hat_k"},
          "vita": {"reference_calls"},
          "finmcp": set()}


def test_required_members_are_the_protocols():
    assert set(REQUIRED) == {"NAME", "load_tasks", "make_env", "score", "reference_messages"}


@pytest.mark.parametrize("name", list(BENCHES))
def test_module_follows_the_interface(name):
    try:
        mod = load_bench(name)
    except (bench.BenchUnavailable, ImportError) as exc:
        pytest.skip(f"{name} is not installed: {exc}")
    assert mod.NAME == name
    for member in REQUIRED:
        assert hasattr(mod, member), f"bench.{name} lacks {member}"
    offered = {cap for cap in OPTIONAL if optional(mod, cap) is not None}
    assert offered == OFFERS[name]
    assert name in bench.__doc__


def test_unknown_capability_is_refused():
    with pytest.raises(KeyError, match="gold_calls"):
        optional(load_bench("toyworld"), "gold_calls")
