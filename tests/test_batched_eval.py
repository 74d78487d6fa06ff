"""Evaluation batched across tasks: every task's committed row and its private rehearsal rows share one
engine batch, tasks join as others leave, and the results equal running each task alone."""
from __future__ import annotations

import pytest
import torch

import kvbatch
from bench import toyworld
from rehearse import EpisodeSpec, RehearsalConfig, act, act_many
from rollout import Engine, SamplingConfig


@pytest.fixture(scope="module")
def eng(micro64):
    model, tok = micro64
    return Engine(model, tok)


def specs(n, greedy, seed=0):
    tasks = toyworld.load_tasks("test", limit=n, seed=seed)
    return [EpisodeSpec(t, SamplingConfig(greedy=greedy, temperature=1.0, max_new_tokens=24, max_world_tokens=16,
                                          max_turns=3, max_total_len=1024, seed=100 + i), make_env=toyworld.make_env)
            for i, t in enumerate(tasks)]


def same(a, b):
    assert torch.equal(a.rollout.ids, b.rollout.ids) and torch.equal(a.rollout.roles, b.rollout.roles)
    assert a.trajectory.end_reason == b.trajectory.end_reason
    assert a.trajectory.observations == b.trajectory.observations
    assert [[r["raw"] for r in turn] for turn in a.rehearsals] == [[r["raw"] for r in turn] for turn in b.rehearsals]
    assert [f["predicted"] for f in a.fidelity] == [f["predicted"] for f in b.fidelity]


@pytest.mark.parametrize("greedy,budget,mode", [(True, 0, "parallel"), (False, 2, "parallel"),
                                                (False, 2, "sequential")])
def test_batched_equals_one_at_a_time(eng, greedy, budget, mode):
    rcfg = RehearsalConfig(budget=budget, mode=mode, fidelity=True)
    runs = specs(4, greedy)
    alone = [act(eng, s.task, s.cfg, s.make_env(s.task), rcfg) for s in runs]
    ended = []
    together = act_many(eng, runs, rcfg, max_rows=2 * (1 + budget), on_done=lambda i, ep: ended.append(i))
    assert sorted(ended) == list(range(4))
    for a, b in zip(alone, together):
        same(a, b)
    assert sum(ep.stats["committed_turns"] for ep in together) >= 4
    if budget:
        assert all(ep.stats["rehearsals"] >= 1 for ep in together if ep.trajectory.calls)


def test_rows_join_as_others_leave(eng):
    """A row budget smaller than the tasks: tasks wait and join; the batch never exceeds the budget."""
    from kvbatch import KVBatch
    seen = []
    original = KVBatch.feed

    def feed(self):
        seen.append(len(self.rows))
        return original(self)

    KVBatch.feed = feed
    try:
        eps = act_many(eng, specs(6, True), RehearsalConfig(budget=0), max_rows=2)
    finally:
        KVBatch.feed = original
    assert max(seen) == 2 and len(eps) == 6 and all(ep.trajectory.end_reason for ep in eps)


def test_specs_must_share_their_sampling_config(eng):
    runs = specs(2, True)
    runs[1].cfg.max_new_tokens = 7
    with pytest.raises(ValueError, match="differ only in their seeds"):
        act_many(eng, runs)


@pytest.mark.parametrize("budget", [0, 2])
def test_cost_figures_add_up_in_a_batch_sharing_a_prompt_head(eng, budget):
    """Toy-world prompts share a 64+-token head (system prompt and tools), prefilled once for the batch:
    extra tokens are never negative (0 at B=0), and the episodes' seconds add up to the batch's wall time."""
    import time
    runs = specs(6, greedy=False)
    t0 = time.perf_counter()
    eps = act_many(eng, runs, RehearsalConfig(budget=budget))
    wall = time.perf_counter() - t0
    for ep in eps:
        assert ep.stats["extra_fed"] >= 0 and ep.stats["extra_sampled"] >= 0
        assert ep.stats["wall_seconds"] >= ep.stats["seconds"] > 0
        if budget == 0:
            assert ep.stats["extra_tokens"] == 0
    assert sum(ep.stats["seconds"] for ep in eps) <= wall
    assert sum(ep.stats["seconds"] for ep in eps) >= 0.5 * wall
    assert sum(ep.stats["wall_seconds"] for ep in eps) > wall     # lifetimes overlap: not a cost


def test_a_memory_budget_caps_the_rows_of_a_batch_and_the_results_stay_the_same(eng):
    """rows = budget / (max_len x KV bytes per token x 2 + vocab x 4): a budget for 2 rows runs 6 tasks 2 at
    a time, with the same episodes as the unbudgeted batch."""
    runs = specs(6, greedy=True)
    per_row = 2 * eng.max_len(runs[0].cfg) * kvbatch.kv_bytes_per_token(eng.model) + 4 * eng.model.config.vocab_size
    assert kvbatch.memory_rows(eng.model, eng.max_len(runs[0].cfg), 2 * per_row + 1) == 2
    assert kvbatch.memory_rows(eng.model, eng.max_len(runs[0].cfg), 1) == 1        # always at least one row
    widest = []
    real_feed = kvbatch.KVBatch.feed

    def spy(batch):
        widest.append(len(batch.rows))
        return real_feed(batch)
    import pytest as _pytest
    with _pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvbatch.KVBatch, "feed", spy)
        capped = act_many(eng, runs, RehearsalConfig(budget=0), memory_budget=2 * per_row + 1)
    assert max(widest) <= 2
    free = act_many(eng, runs, RehearsalConfig(budget=0))
    for a, b in zip(capped, free):
        same(a, b)
    ro = eng.run([s.task for s in runs[:3]], 2, runs[0].cfg, make_env=toyworld.make_env)
    eng.memory_budget = 2 * per_row + 1
    try:
        again = eng.run([s.task for s in runs[:3]], 2, runs[0].cfg, make_env=toyworld.make_env)
    finally:
        eng.memory_budget = None
    assert torch.equal(ro.ids, again.ids) and ro.end_reasons == again.end_reasons
