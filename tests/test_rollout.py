import copy
import dataclasses
import json

import pytest
import torch

import grpo
import kvbatch
import rollout
from chat_format import TemplateError, derive_chat_format, parse_turn
from rollout import Engine, Role, SamplingConfig
from tests.scripted import TOOLS, EchoEnv, Script, call_text, tasks

LOOKUP = [call_text("lookup", '{"key": "'), 3, '"}}\n</tool_call>']
PING = [call_text("ping", "{}}\n</tool_call>")]
ANSWER = ["done ", 2]
WORLD = ['{"value": "', 4, '"}\n</tool_response>']


@pytest.fixture(scope="module")
def tiny64(micro64):
    return micro64


def ragged_script(tok):
    # rows differ in number of turns, parallel calls and which calls are rehearsed: a ragged batch
    act = {0: [LOOKUP, ANSWER],
           1: [LOOKUP + ["\n"] + PING, LOOKUP, ANSWER],
           2: [ANSWER, LOOKUP, ANSWER],
           3: [PING, LOOKUP, ANSWER]}
    world = {r: [['{"v": "', 2, '"}\n</tool_response>']] * 4 for r in range(4)}
    return Script(tok, act, world)


def run_ragged(model, tok, use_cache, cfg=None):
    followups = {"t0": ["and one more?"], "t1": ["and now?"]}
    eng = Engine(model, tok)
    return eng.run(tasks(2), group_size=2, cfg=cfg or SamplingConfig(greedy=True, max_new_tokens=80, seed=0),
                   make_env=lambda t: EchoEnv(followups[t.id]), responses=lambda row, call: row % 2 == 0,
                   use_cache=use_cache, steer=ragged_script(tok))


def test_cached_generation_equals_uncached(tiny64):
    model, tok = tiny64
    cached = run_ragged(model, tok, use_cache=True)
    fresh = run_ragged(model, tok, use_cache=False)
    assert cached.ids.shape == fresh.ids.shape
    assert torch.equal(cached.ids, fresh.ids)
    assert torch.equal(cached.roles, fresh.roles)
    assert cached.end_reasons == fresh.end_reasons
    torch.testing.assert_close(cached.logprobs, fresh.logprobs, atol=1e-9, rtol=0)
    # the batch really was ragged and multi-turn, and the free slots were the model's own choice
    assert len(set(cached.lengths.tolist())) == 4
    assert max(len(t.calls) for t in cached.trajectories) >= 3
    assert [c.name for c in cached.trajectories[1].calls] == ["lookup", "ping", "lookup"]  # 2 parallel
    assert (cached.roles == Role.WORLD).any() and (cached.roles == Role.OBS).any()
    # the cached path fed far fewer tokens than re-encoding
    assert cached.stats["tokens_fed"] * 3 < fresh.stats["tokens_fed"]


def test_recorded_logprobs_equal_full_forward(tiny64):
    model, tok = tiny64
    for cfg in (SamplingConfig(greedy=True, max_new_tokens=80),
                SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=80, seed=3)):
        out = run_ragged(model, tok, use_cache=True, cfg=cfg)
        temp = 1.0 if cfg.greedy else cfg.temperature
        for b in range(out.ids.shape[0]):
            n = int(out.lengths[b])
            ids = out.ids[b, :n]
            with torch.no_grad():
                logits = model(input_ids=ids[None]).logits[0].double()
            logp = torch.log_softmax(logits[:-1] / temp, -1).gather(-1, ids[1:, None])[:, 0]
            sampled = (out.roles[b, 1:n] == Role.ACT) | (out.roles[b, 1:n] == Role.WORLD)
            assert sampled.sum() > 5
            torch.testing.assert_close(out.logprobs[b, 1:n][sampled].double(), logp[sampled], atol=1e-6, rtol=0)
            assert torch.all(out.logprobs[b, :n][~((out.roles[b, :n] == Role.ACT) | (out.roles[b, :n] == Role.WORLD))] == 0)


def test_roles_are_exact_on_a_scripted_conversation(tiny64):
    model, tok = tiny64
    eng = Engine(model, tok)
    env = EchoEnv(["next question"])
    script = Script(tok, {0: [LOOKUP + ["\n"] + PING, ANSWER, ANSWER]}, {0: [WORLD]})
    out = eng.run(tasks(1), cfg=SamplingConfig(greedy=True, max_new_tokens=80), make_env=lambda t: env,
                  responses=lambda row, call: call.name == "lookup", steer=script)
    ids, roles, traj = out.ids[0].tolist(), out.roles[0].tolist(), out.trajectories[0]
    prompt = eng.prompt_ids(tasks(1)[0])
    assert roles[:len(prompt)] == [Role.PROMPT] * len(prompt) and ids[:len(prompt)] == prompt

    def text_of(role):
        return [tok.decode([i for i, r in zip(ids[s.start:s.end], roles[s.start:s.end])])
                for s in out.spans[0] if s.role == role]

    act = text_of(Role.ACT)
    assert len(act) == 3 and all(a.endswith("<|im_end|>") for a in act)
    assert act[0].startswith('<tool_call>\n{"name": "lookup"') and '"name": "ping"' in act[0]
    assert act[1].startswith("done ") and act[2].startswith("done ")
    world = text_of(Role.WORLD)
    assert len(world) == 1 and world[0].startswith('{"value": "') and world[0].endswith('"}\n</tool_response>')
    obs = text_of(Role.OBS)
    assert [o.strip() for o in obs] == [json.dumps({"tool": "ping", "args": {}, "n": 1})]
    assert env.calls == [("ping", {})]                      # the rehearsed lookup never reached the env
    assert traj.rehearsed == [True, False] and traj.observations[0] == world[0][: -len("\n</tool_response>")]
    # every other token is engine-written scaffolding or user text
    prompt_text = "".join(text_of(Role.PROMPT))
    assert "next question" in prompt_text and prompt_text.count("<|im_start|>assistant\n") == 3
    assert out.end_reasons == ["final_answer"] and traj.final_answer.startswith("done")
    assert all(r != Role.PAD for r in roles)


def test_ids_decode_to_the_chat_template_rendering(tiny64):
    model, tok = tiny64
    eng = Engine(model, tok)
    script = Script(tok, {0: [LOOKUP, ANSWER], 1: [PING, ANSWER]})
    out = eng.run(tasks(1), group_size=2, cfg=SamplingConfig(greedy=True, max_new_tokens=80),
                  make_env=lambda t: EchoEnv(), responses="real", steer=script)
    for b in range(2):
        traj = out.trajectories[b]
        n = int(out.lengths[b])
        rendered = tok.apply_chat_template([{k: v for k, v in m.items() if k in ("role", "content", "tool_calls")}
                                            for m in traj.messages], tools=TOOLS, tokenize=False)
        assert tok.decode(out.ids[b, :n].tolist()) + eng.fmt.after_eos == rendered


def test_each_malformed_call_gives_its_typed_error_and_the_batch_survives(tiny64):
    model, tok = tiny64
    cases = {
        0: ([call_text("lookup", '{"key": "a"}}}\n</tool_call>')], "malformed_json"),   # one brace too many
        1: ([call_text("nosuch", '{"key": "a"}}\n</tool_call>')], "unknown_tool"),
        2: ([call_text("lookup", '{"other": "a"}}\n</tool_call>')], "missing_arguments"),
        3: ([call_text("lookup", '{"key": "'), 200], "truncated_turn"),        # cut off by max_new_tokens
        4: ([], "empty_turn"),
        5: (['<tool_call>\n"just a string"\n</tool_call>'], "not_an_object"),
    }
    act = {r: [items, ANSWER] for r, (items, _) in cases.items()}
    act[6] = [LOOKUP, ANSWER]                                                   # a healthy row alongside
    eng = Engine(model, tok)
    out = eng.run(tasks(1), group_size=7, cfg=SamplingConfig(greedy=True, max_new_tokens=60),
                  make_env=lambda t: EchoEnv(), responses="real", steer=Script(tok, act))
    for r, (_, kind) in cases.items():
        errors = out.trajectories[r].errors
        assert any(e.startswith(kind) for e in errors), (r, errors)
    assert out.end_reasons[3] == "max_new_tokens" and out.end_reasons[4] == "empty_turn"
    for r in (0, 1, 2, 5):   # the episode went on after an error observation
        assert out.end_reasons[r] == "final_answer"
        assert '{"error": ' in tok.decode(out.ids[r][out.roles[r] == Role.OBS].tolist())
    assert out.end_reasons[6] == "final_answer" and out.trajectories[6].errors == []


def test_limits_end_rows_cleanly(tiny64):
    model, tok = tiny64
    eng = Engine(model, tok)
    loop = {0: [LOOKUP] * 10, 1: [LOOKUP] * 10}
    out = eng.run(tasks(1), group_size=2, cfg=SamplingConfig(greedy=True, max_new_tokens=80, max_turns=3),
                  make_env=lambda t: EchoEnv(), responses="real", steer=Script(tok, loop))
    assert out.end_reasons == ["max_turns", "max_turns"] and len(out.trajectories[0].calls) == 3
    n_prompt = len(eng.prompt_ids(tasks(1)[0]))
    out = eng.run(tasks(1), cfg=SamplingConfig(greedy=True, max_new_tokens=80, max_total_len=n_prompt + 30),
                  make_env=lambda t: EchoEnv(), responses="real", steer=Script(tok, loop))
    assert out.end_reasons == ["max_length"] and int(out.lengths[0]) <= n_prompt + 30
    out = eng.run(tasks(1), cfg=SamplingConfig(max_total_len=10), make_env=lambda t: EchoEnv())
    assert out.end_reasons == ["max_length"] and "context_too_long" in out.trajectories[0].errors[0]


def test_unterminated_rehearsal_is_closed_and_recorded(tiny64):
    model, tok = tiny64
    eng = Engine(model, tok)
    script = Script(tok, {0: [LOOKUP, ANSWER]}, {0: [['{"value": ', 50]]})
    out = eng.run(tasks(1), cfg=SamplingConfig(greedy=True, max_new_tokens=80, max_world_tokens=12),
                  steer=script)
    assert "unterminated" in out.rehearsal_defects[0] and "invalid_json" in out.rehearsal_defects[0]
    assert out.end_reasons == ["final_answer"]
    assert (out.roles[0] == Role.WORLD).sum() == 12


def test_template_that_is_not_append_only_is_refused(tiny64):
    _, tok = tiny64
    bad = copy.deepcopy(tok)
    bad.chat_template = tok.chat_template.replace("messages[0].content + '\\n\\n'",
                                                  "messages[0].content + (messages|length|string) + '\\n\\n'")
    with pytest.raises(TemplateError, match="append-only") as err:
        derive_chat_format(bad)
    assert err.value.reason == "not_append_only"


def test_parse_turn_is_total():
    cases = ["", "plain answer", "<tool_call>{bad</tool_call>", "<tool_call>[1]</tool_call>",
             '<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": "ping", "arguments": "x"}</tool_call>',
             '<tool_call>{"name": "ping", "arguments": "{}"}</tool_call>', "</tool_call>", "<tool_call>{",
             "<think>hmm <tool_call></think>ok"]
    kinds = []
    for text in cases:
        turn = parse_turn(text, TOOLS)
        kinds.append([getattr(i, "kind", "call") for i in turn.items])
    assert kinds == [[], [], ["malformed_json"], ["not_an_object"], ["missing_name"], ["bad_arguments"],
                     ["call"], ["stray_close_tag"], ["unterminated_call"], []]


def test_role_mask_selects_only_trained_roles():
    roles = torch.tensor([[1, 2, 2, 3, 4, 1, 0]])
    assert grpo.role_mask(roles, [Role.ACT, Role.WORLD]).tolist() == [[False, True, True, True, False, False, False]]
    assert grpo.role_mask(roles, [Role.ACT]).tolist() == [[False, True, True, False, False, False, False]]


def test_preallocated_kv_cache_matches_dynamic_cache_through_every_operation():
    """Growth past capacity, batch selection, forking (deepcopy + repeat_interleave) and cropping: the
    preallocated layer must hold exactly what transformers' concatenating DynamicCache holds."""
    from transformers import DynamicCache
    gen = torch.Generator().manual_seed(0)
    ours, ref = kvbatch.new_kv_cache(), DynamicCache()

    def feed(n, batch):
        for layer in range(2):
            k, v = torch.randn(batch, 2, n, 8, generator=gen), torch.randn(batch, 2, n, 8, generator=gen)
            got, want = ours.update(k, v, layer), ref.update(k, v, layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def same(a, b):
        assert a.get_seq_length() == b.get_seq_length()
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)

    feed(50, 3)
    for _ in range(40):          # past the first 64-slot buffer: grows, copies the filled part
        feed(1, 3)
    same(ours, ref)
    keep = torch.tensor([2, 0])
    ours.batch_select_indices(keep), ref.batch_select_indices(keep)
    feed(5, 2)
    same(ours, ref)
    twin_ours, twin_ref = copy.deepcopy(ours), copy.deepcopy(ref)
    twin_ours.batch_repeat_interleave(3), twin_ref.batch_repeat_interleave(3)
    ours.crop(-7), ref.crop(-7)
    same(ours, ref)
    for layer in range(2):       # the fork is independent: writing into it leaves the original alone
        k = torch.randn(6, 2, 4, 8, generator=gen)
        twin_ours.update(k, k, layer), twin_ref.update(k, k, layer)
    same(twin_ours, twin_ref)
    same(ours, ref)
    feed(3, 2)                   # after a crop, new tokens overwrite the cropped slots
    same(ours, ref)
    plain, plain_ref = copy.deepcopy(ours), copy.deepcopy(ref)   # no batch change: must not share buffers
    for layer in range(2):
        plain.update(torch.ones(2, 2, 1, 8), torch.ones(2, 2, 1, 8), layer)
        plain_ref.update(torch.ones(2, 2, 1, 8), torch.ones(2, 2, 1, 8), layer)
    feed(1, 2)
    same(ours, ref)
    same(plain, plain_ref)


def test_a_world_model_writes_the_world_segments_from_its_own_cache(micro64):
    """Another model writes WORLD tokens (a frozen simulator or a world model trained apart): every token's
    recorded log-prob equals a full forward of the model that sampled it, ACT tokens the policy's, WORLD
    tokens the world model's; with the policy itself as world model the rollout is unchanged."""
    import copy as copy_module
    model, tok = micro64
    other = copy_module.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eng = Engine(model, tok)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=48, max_world_tokens=12, max_turns=3, seed=3)
    acts = {r: [LOOKUP, ANSWER] for r in range(4)}          # calls forced; the world segments are sampled freely
    plain = eng.run(tasks(2), 2, cfg, steer=Script(tok, acts))
    same = eng.run(tasks(2), 2, cfg, steer=Script(tok, acts), world_model=model)
    assert torch.equal(plain.ids, same.ids) and torch.allclose(plain.logprobs, same.logprobs, atol=1e-9)
    out = eng.run(tasks(2), 2, cfg, steer=Script(tok, acts), world_model=other)
    assert not torch.equal(out.ids, plain.ids)
    assert (out.roles == Role.WORLD).any() and (out.roles == Role.ACT).any()
    for b in range(out.ids.shape[0]):
        n = int(out.lengths[b])
        ids = out.ids[b:b + 1, :n]
        for role, m in ((Role.ACT, model), (Role.WORLD, other)):
            with torch.no_grad():
                logp = torch.log_softmax(m(input_ids=ids).logits[0, :-1].double(), -1)
            pos = torch.nonzero(out.roles[b, 1:n] == role).flatten()
            want = logp[pos, ids[0, pos + 1]]
            assert torch.allclose(out.logprobs[b, pos + 1].double(), want, atol=1e-6), (b, role)


@pytest.mark.parametrize("unset", ["empty", "nan"])
def test_kv_batch_cache_rows_stay_exact_through_every_operation(micro64, monkeypatch, unset):
    """Each row holds one KV-cache row: joining rows are written into free rows (a prompt longer than the
    cache widens it), long feeds are fed apart from the one-token rows in forwards grouped by length (over
    those rows only, or over every row when they are many), forks copy a row, a parent lends its row to a
    child and gets it back cut to its own tokens, rows leave, and the cache is packed once holes pile up.
    After each step every row's next-token logits equal a full forward of its tokens, and its mask holds
    exactly its cached tokens. With buffers' unset room full of NaN, no unset value is ever read."""
    from kvbatch import KVBatch
    from rollout import Row
    if unset == "nan":
        monkeypatch.setattr(kvbatch, "kv_buffer", lambda like, shape: like.new_full(shape, float("nan")))
    model, tok = micro64
    gen = torch.Generator().manual_seed(0)
    task = tasks(1)[0]
    batch = KVBatch(model, tok.pad_token_id)

    def ids(n):
        return torch.randint(5, 1000, (n,), generator=gen).tolist()

    def check():
        slots = [r.slot for r in batch.rows if r.slot >= 0]
        assert len(set(slots)) == len(slots) and not set(slots) & set(batch.free)
        for r in batch.rows:
            if r.slot < 0:
                continue
            assert int(batch.lanes[0].mask[r.slot].sum()) == r.n_cached == len(r.ids)
            with torch.no_grad():
                want = model(input_ids=torch.tensor([r.ids])).logits[0, -1].float()
            torch.testing.assert_close(batch.lanes[0].logits[r.slot], want, atol=1e-5, rtol=0)

    shared = ids(30)
    rows = [Row(task, p) for p in (shared, ids(12), shared, ids(50), ids(7))]
    batch.admit(rows)
    check()
    for r, n in zip(rows, (1, 40, 3, 0, 17)):          # ragged: one-token rows and long feeds together
        r.ids += ids(n)
    batch.feed()
    check()
    kid = rows[1].fork(1, 0, "private")                 # a copy of rows[1]'s cache row
    batch.fork(rows[1], kid)
    lent = rows[2].fork(2, 0, "private")                # rows[2]'s own row, while it waits
    batch.lend(rows[2], lent)
    assert rows[2].slot == -1 and lent.slot >= 0
    batch.rows += [kid, lent]
    kid.ids += ids(9)
    lent.ids += ids(25)
    rows[0].ids += ids(1)
    batch.feed()
    check()
    batch.drop([lent, rows[4]])                         # rows[2] gets its row back, cut to its tokens
    check()
    rows[2].ids += ids(4)
    batch.admit([Row(task, ids(300))])                  # longer than the cache: widened
    batch.feed()
    check()
    head = ids(70)                                      # prompts sharing a head: the head prefilled once
    fed = batch.tokens_fed
    joining = [Row(task, head + ids(6)), Row(task, head + ids(19)), Row(task, list(head))]
    batch.admit(joining)
    assert batch.tokens_fed - fed == 70 and [r.n_cached for r in joining] == [70, 70, 70]
    batch.feed()
    assert batch.tokens_fed - fed == 70 + 6 + 19
    check()
    for step in range(40):                              # many long feeds to a few rows: holes, then packing
        live = [r for r in batch.rows if r.slot >= 0]
        for k, r in enumerate(live):
            if (k + step) % 3 == 0:
                r.ids += ids(int(torch.randint(1, 30, (1,), generator=gen)))
            elif step % 4 == 0:                         # sometimes most rows at once: over every row
                r.ids += ids(2 + k)
        batch.feed()
        check()
        if step == 20:
            batch.drop(live[:2])
            batch.admit([Row(task, ids(20)), Row(task, ids(5))])
    assert batch.compactions >= 1 and batch.forward_calls > 2 * 40
    parent = next(r for r in batch.rows if r.slot >= 0)  # a parent that ends in the step its lent child ends
    child = parent.fork(3, 0, "private")
    batch.lend(parent, child)
    batch.rows.append(child)
    held = batch.held
    batch.drop([parent, child])                         # frees the row it got back, once
    assert batch.held == held - 1 and all(0 <= s < batch.slots for s in batch.free)
    assert len(set(batch.free)) == len(batch.free)
    batch.admit([Row(task, ids(8))])
    check()


def test_length_groups_cover_every_feed_once_longest_first():
    from kvbatch import length_groups
    lengths = [5, 100, 90, 6, 40, 1, 95]
    groups = length_groups(lengths)
    assert sorted(k for g in groups for k in g) == list(range(len(lengths)))
    order = [lengths[k] for g in groups for k in g]
    assert order == sorted(order, reverse=True) and len(groups) > 1
    assert length_groups([]) == [] and length_groups([3, 3, 3]) == [[0, 1, 2]]


def test_top_p_cut_keeps_what_a_full_sort_keeps():
    from rollout import top_p_cut
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([5.0, 0.1, 3.0, 1.0, 8.0, 0.01])[:, None]
    probs = torch.softmax(torch.randn(6, 300, generator=gen) * scale, -1)
    for top_p in (0.5, 0.95, 0.999):
        s, order = probs.sort(dim=-1, descending=True)
        want = torch.zeros_like(probs).scatter(-1, order, s.masked_fill(s.cumsum(-1) - s > top_p, 0.0))
        got = top_p_cut(probs, top_p, head=16)   # some rows' heads are longer than 16: sorted whole
        assert torch.equal(got, want)
        assert all(torch.equal(top_p_cut(probs[k:k + 1], top_p, head=16)[0], got[k]) for k in range(6))


@pytest.mark.parametrize("respond", [False, True])
def test_single_turn_task_responds_to_its_call_only_when_asked(tiny64, respond):
    """A task's own turn limit (single-turn BFCL) ends the episode after its call; respond_at_turn_limit writes
    the call's response first: rehearsed (WORLD) or executed (OBS), then the row ends, no further ACT turn."""
    model, tok = tiny64
    task = dataclasses.replace(tasks(1)[0], max_assistant_turns=1)
    script = Script(tok, {r: [LOOKUP, ANSWER] for r in range(2)}, {r: [WORLD] for r in range(2)})
    out = Engine(model, tok).run([task], group_size=2, cfg=SamplingConfig(
        greedy=True, max_new_tokens=40, seed=0, respond_at_turn_limit=respond), make_env=lambda t: EchoEnv(),
        responses=lambda row, call: row == 0, steer=script)
    assert out.end_reasons == ["max_turns", "max_turns"]
    for row, traj in enumerate(out.trajectories):
        assert [c.name for c in traj.calls] == ["lookup"]
        assert [m["role"] for m in traj.messages[-2:]] == (["assistant", "tool"] if respond else ["user", "assistant"])
        assert traj.rehearsed == ([row == 0] if respond else [None])
    assert bool((out.roles[0] == Role.WORLD).any()) == respond
    assert bool((out.roles[1] == Role.OBS).any()) == respond
    assert int((out.roles == Role.ACT).any(-1).sum()) == 2      # one ACT turn per row, nothing after the response
