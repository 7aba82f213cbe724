"""Speculative decoding (speculative="ngram") gives the tokens of plain decoding, with logprobs from the
verify forward: greedy and seeded sampling (truncation, penalties, top logprobs), groups, stops inside
an accepted run, max_new_tokens within a draft, preemption, abort, a weight update; rejected drafts'
pages are freed. The n-gram drafter on its own. Every comparison checks that drafts were accepted
(else it proves nothing) and that some were rejected."""
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from hf_reference import cpu_engine, random_prompts
from rollout import RolloutEngine, SamplingParams
from rollout.request import PLACEHOLDER, Request
from rollout.config import EngineConfig
from rollout.spec import CONTROL_STEPS, MAX_SLOW_BACKOFF, PROBE_EVERY, REFRESH_STEPS, NgramDrafter, Speculator
from rollout.worker import RolloutWorker

K = 5
# fp32: the verify forward computes k+1 positions in one GEMM where plain decoding computes one, so
# sums round in another order: ~1e-6 on these logprobs (the tests' fp32 noise budget is 1e-5).
TOL = 1e-5


def _spec(path, padded=False, **kw):
    """padded: drafted steps in the verify graphs' padded layout (inert padding tokens, rows and sequences),
    which CUDA replays as graphs; here eagerly, so that it is held to the same equalities."""
    eng = cpu_engine(path, **{"speculative": "ngram", "spec_max_draft": K, "spec_history_prompts": 16, **kw})
    eng.pipeline.pad_verify = padded
    return eng


PADDED = pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])


def _prompts(tok, n=3):
    """Repetitive prompts (a phrase three times), so that n-gram drafts often hold."""
    return [p + p[1:] + p[1:] for p in random_prompts(tok, n, 8, 20, seed=3)]


def assert_same(a, b, top=False):
    for x, y in zip(a, b, strict=True):
        assert len(x.completions) == len(y.completions)
        for cx, cy in zip(x.completions, y.completions):
            assert cx.token_ids == cy.token_ids
            assert (cx.finish_reason, cx.stop_reason, cx.text) == (cy.finish_reason, cy.stop_reason, cy.text)
            for f in ("logprobs", "processed_logprobs", "kept_mass"):
                assert len(getattr(cx, f)) == len(cx.token_ids)
                assert_close(getattr(cx, f), getattr(cy, f))
            if top:
                for tx, ty in zip(cx.top_logprobs, cy.top_logprobs, strict=True):
                    assert tx.keys() == ty.keys() and max(abs(tx[t] - ty[t]) for t in tx) < TOL


def assert_close(u, v):
    assert len(u) == len(v) and max((abs(p - q) for p, q in zip(u, v)), default=0) < TOL


def assert_no_leak(eng):
    assert eng.kv.alloc.num_used == 0 and all(r == 0 for r in eng.kv.alloc.refcount)


def test_drafter_own_context_siblings_and_history():
    d = NgramDrafter(history_prompts=2)
    req = Request(0, [1, 2, 3, 4, 5], SamplingParams(n=2), seed=0)
    seq = req.seqs[0]
    assert d.propose(seq, 4) == []                       # no earlier occurrence of its suffix
    seq.token_ids += [9, 4, 5]                           # suffix (4, 5) occurred before, then 9: period 3
    assert d.propose(seq, 7) == [9, 4, 5, 9, 4, 5, 9]    # the period repeats past the end
    # A sibling's output: a longer match (3 tokens) than the own context's (2) wins; its known tokens
    # end the draft (an in-flight PLACEHOLDER is never drafted from).
    sib = Request(0, [1, 2, 3, 4, 5], SamplingParams(n=2), seed=0).seqs[0]
    sib.request = req
    sib.token_ids += [8, 9, 4, 5, 6, 6, 7, PLACEHOLDER]
    req.seqs.append(sib)
    seq.token_ids[-3:] = [8, 9, 4]
    assert d.propose(seq, 3) == [5, 6, 6]
    assert d.propose(seq, 9) == [5, 6, 6, 7]
    sib.token_ids[-1] = 3                                 # landed: drafted from, and indexed incrementally
    assert d.propose(seq, 9) == [5, 6, 6, 7, 3]
    # Earlier completions of the same prompt, remembered when their request finished.
    d.remember(req)
    later = Request(1, [1, 2, 3, 4, 5], SamplingParams(), seed=0).seqs[0]
    assert d.propose(later, 3) == [8, 9, 4]              # the prompt's end, matched in the earlier ones
    other = Request(2, [7, 7, 3, 5], SamplingParams(), seed=0).seqs[0]
    assert d.propose(other, 2) == []                     # another prompt: no history, no match
    # An earlier completion with the same tokens up to here is followed where they are (a run of 7s
    # longer than MAX_MATCH also matches, as long, at its end: the aligned place wins).
    done = Request(7, [1, 2], SamplingParams(), seed=0)
    done.seqs[0].token_ids += [7] * 20 + [9]
    d.remember(done)
    again = Request(8, [1, 2], SamplingParams(), seed=0).seqs[0]
    again.token_ids += [7] * 18
    assert d.propose(again, 4) == [7, 7, 9]
    d.remember(Request(3, [6, 6], SamplingParams(), seed=0))   # nothing generated: nothing kept
    assert len(d.history) == 2
    for i in range(3):                                    # history keeps the latest history_prompts prompts
        r = Request(4 + i, [i, i], SamplingParams(), seed=0)
        r.seqs[0].token_ids.append(5)
        d.remember(r)
    assert len(d.history) <= 2 and tuple(req.prompt_ids) not in d.history


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=5),
    dict(temperature=0.9, top_p=0.9, top_k=20, min_p=0.02, seed=7, top_logprobs=3),
    dict(temperature=1.0, repetition_penalty=1.3, seed=9),
], ids=["greedy", "seeded", "truncated", "penalty"])
@PADDED
def test_same_tokens_and_logprobs_as_plain_decoding(model_dir, tiny_tokenizer, params, padded):
    """Three rounds on one engine (groups of n=3): round 2 drafts from round 1's completions of the same
    prompts (the same seed: the same tokens, accepted), round 3 under another seed (mostly rejected)."""
    path = model_dir("llama")
    prompts = _prompts(tiny_tokenizer)
    spec, plain = _spec(path, padded), cpu_engine(path)
    for seed_shift in (0, 0, 1):
        p = SamplingParams(n=3, max_new_tokens=40, ignore_eos=True, **params)
        if p.seed is not None:
            p.seed += seed_shift
        elif seed_shift:
            prompts = [q[:-1] + [q[-1] + 1] for q in prompts]   # greedy: another prompt end
        assert_same(spec.generate(prompts, p, use_tqdm=False), plain.generate(prompts, p, use_tqdm=False),
                    top=bool(p.top_logprobs))
    st = spec.stats()
    assert st["spec_accepted"] > 0 and st["spec_drafted"] > st["spec_accepted"], st
    assert st["steps"] < plain.stats()["steps"]          # accepted drafts saved steps
    assert st["generated_tokens"] == plain.stats()["generated_tokens"]
    # padded: every drafted step but those a penalty or top logprobs keep unpadded
    assert (st["verify_padded_steps"] > 0) == (padded and not p.repetition_penalty != 1.0 and not p.top_logprobs)
    assert_no_leak(spec)


def _stops_inside_runs(eng):
    """Record, for each stop the scheduler finds, whether a drafted position followed it."""
    seen, orig = [], eng.scheduler._stop_reason

    def spy(seq, pos):
        reason = orig(seq, pos)
        if reason is not None:
            seen.append(len(seq.token_ids) > pos + 1 and seq.token_ids[pos + 1] != PLACEHOLDER)
        return reason
    eng.scheduler._stop_reason = spy
    return seen


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids", "stop_strings"])
@PADDED
def test_stop_inside_an_accepted_run(model_dir, tiny_tokenizer, stop, padded):
    path = model_dir("llama")
    prompts = _prompts(tiny_tokenizer, 1)
    long = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    spec, plain = _spec(path, padded), cpu_engine(path)
    out = spec.generate(prompts, long, use_tqdm=False)[0].completions[0].token_ids   # round 2 drafts from it
    # The prefill samples token 0; then each step verifies K drafts (all accepted: round 1 is the
    # same greedy run) and gains K + 1 tokens. Stop at a token first seen at m, not the last of a run.
    m = next(m for m in range(K + 2, len(out)) if out[m] not in out[:m] and (m - 1) % (K + 1) != K)
    kw = {}
    if stop == "stop_strings":
        kw["stop"] = [tiny_tokenizer.decode(out[m - 1:m + 1])]
    elif stop == "stop_token_ids":
        kw["stop_token_ids"] = [out[m]]
    else:       # EOS from a generation config: engines on the same models with this id as EOS
        gen = SimpleNamespace(eos_token_id=out[m])
        drafter = spec.speculator.drafter                   # holds round 1's completions
        spec, plain = (RolloutEngine(e.model, e.hf_config, e.config, tokenizer=e.tokenizer, generation_config=gen)
                       for e in (spec, plain))
        spec.speculator.drafter = drafter
        spec.pipeline.pad_verify = padded
    p = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=stop != "eos", **kw)
    seen = _stops_inside_runs(spec)
    a, b = spec.generate(prompts, p, use_tqdm=False), plain.generate(prompts, p, use_tqdm=False)
    assert_same(a, b)
    assert any(c.finish_reason == "stop" for o in a for c in o.completions)
    assert any(seen), seen       # a stop with drafted positions after it: rolled back to the stop
    assert spec.stats()["spec_accepted"] > 0 and (spec.stats()["verify_padded_steps"] > 0) == padded
    assert_no_leak(spec)


@PADDED
def test_max_new_tokens_cuts_the_draft(model_dir, tiny_tokenizer, padded):
    """No row samples past max_new_tokens: the last step verifies only the drafts that fit."""
    path = model_dir("llama")
    prompts = _prompts(tiny_tokenizer, 1)
    spec, plain = _spec(path, padded), cpu_engine(path)
    spec.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    before = spec.stats()
    # prefill: token 0; step 2: K drafts, tokens 1..K+1; step 3: room for 2 more drafts (10 tokens).
    p = SamplingParams(max_new_tokens=K + 5, temperature=0, ignore_eos=True)
    a, b = spec.generate(prompts, p, use_tqdm=False), plain.generate(prompts, p, use_tqdm=False)
    assert_same(a, b)
    assert a[0].completions[0].finish_reason == "length" and len(a[0].completions[0].token_ids) == K + 5
    st = spec.stats()
    assert st["spec_drafted"] - before["spec_drafted"] == K + 2 == st["spec_accepted"] - before["spec_accepted"]
    assert st["steps"] - before["steps"] == 3
    assert_no_leak(spec)


@PADDED
def test_rejected_drafts_pages_are_freed(model_dir, tiny_tokenizer, padded):
    """4-token pages, so verified runs cross pages: between steps no sequence holds a page past its
    tokens, and every page is free at the end."""
    path = model_dir("llama")
    prompts = _prompts(tiny_tokenizer)
    p = SamplingParams(n=2, max_new_tokens=40, temperature=0, ignore_eos=True)
    spec, plain = _spec(path, padded, page_size=4, num_kv_pages=512), cpu_engine(path, page_size=4, num_kv_pages=512)
    freed, roll_back = [], spec.scheduler._roll_back

    def spy(seq, pos):          # pages a rolled-back run gives up, checked free
        held = list(seq.block_table)
        roll_back(seq, pos)
        gone = held[len(seq.block_table):]
        assert all(spec.kv.alloc.refcount[g] == 0 for g in gone)
        freed.extend(gone)
    spec.scheduler._roll_back = spy
    spec.add_requests(prompts, p)                    # drafts from their own context: partly right
    outs = []
    while spec.has_unfinished():
        outs += spec.step()
        for seq in spec.scheduler.running:
            assert len(seq.block_table) <= spec.kv.pages_for(seq.num_tokens), seq
    st = spec.stats()
    assert st["spec_drafted"] > st["spec_accepted"] > 0, st
    assert freed
    assert_same(sorted(outs, key=lambda o: o.request_id), plain.generate(prompts, p, use_tqdm=False))
    assert_no_leak(spec)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@PADDED
def test_preemption_under_speculation(model_dir, tiny_tokenizer, temperature, padded):
    path = model_dir("llama")
    prompts = _prompts(tiny_tokenizer, 4)
    p = SamplingParams(n=2, max_new_tokens=60, temperature=temperature, seed=11, ignore_eos=True)
    ref = cpu_engine(path).generate(prompts, p, use_tqdm=False)
    tight = _spec(path, padded, num_kv_pages=24, max_num_batched_tokens=64, kv_reserve_fraction=0.0)
    tight.generate(prompts, p, use_tqdm=False)        # round 1 (history), under pressure too
    outs = tight.generate(prompts, p, use_tqdm=False)
    st = tight.stats()
    assert st["preemptions"] > 0 and st["spec_accepted"] > 0, st
    assert_same(outs, ref)
    assert_no_leak(tight)


def test_abort_during_speculation(model_dir, tiny_tokenizer):
    path = model_dir("llama")
    prompts = _prompts(tiny_tokenizer)
    p = SamplingParams(n=2, max_new_tokens=40, temperature=0, ignore_eos=True)
    ref = cpu_engine(path).generate(prompts, p, use_tqdm=False)
    spec = _spec(path)
    spec.generate(prompts, p, use_tqdm=False)
    rids = spec.add_requests(prompts, p)
    outs, accepted = [], spec.stats()["spec_accepted"]
    while spec.stats()["spec_accepted"] < accepted + 3 * K:       # a few drafted steps into round 2
        outs += spec.step()
    assert not outs
    aborted = spec.abort([rids[1]])[0]
    for c, r in zip(aborted.completions, ref[1].completions):
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 40
        assert c.token_ids == r.token_ids[:len(c.token_ids)] and len(c.logprobs) == len(c.token_ids)
    while spec.has_unfinished():
        outs += spec.step()
    assert_same(sorted(outs, key=lambda o: o.request_id), [ref[0], ref[2]])
    assert_no_leak(spec)


def test_a_failed_drafted_step_fails_its_requests_only(model_dir, tiny_tokenizer, monkeypatch):
    """A fault in a drafted step: its requests finish with "error" holding only verified tokens (the
    drafts dropped), no page leaks, and the engine serves the next requests."""
    path = model_dir("llama")
    prompts = _prompts(tiny_tokenizer, 2)
    p = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    spec = _spec(path)
    ref = spec.generate(prompts, p, use_tqdm=False)
    real_run = spec.runner.run

    def flaky(dev, *a, **k):
        if dev.num_rows > len(prompts) and spec.metrics["failed_steps"] == 0:   # rows of drafted positions
            raise RuntimeError("simulated device fault")
        return real_run(dev, *a, **k)
    monkeypatch.setattr(spec.runner, "run", flaky)
    outs = spec.generate(prompts, p, use_tqdm=False)
    assert spec.metrics["failed_steps"] == 1
    for o, r in zip(outs, ref):
        c = o.completions[0]
        assert c.finish_reason == "error" and len(c.logprobs) == len(c.token_ids) < 30
        assert c.token_ids == r.completions[0].token_ids[:len(c.token_ids)]
    assert_no_leak(spec)
    assert_same(spec.generate(prompts, p, use_tqdm=False), ref)


def test_weight_update_between_drafted_steps_keeps_versions_exact(model_dir, tiny_tokenizer):
    """Greedy, stale_kv="recompute": the tokens of version 0 are the old weights' run, the rest the new
    weights' continuation of them; each token's logprob is that of its version's weights."""
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    prompts = _prompts(tiny_tokenizer, 2)
    p = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stale_kv="recompute")
    ref_old = cpu_engine(old).generate(prompts, p, use_tqdm=False)
    worker = RolloutWorker(_spec(old))
    worker.generate(prompts, p)                       # history
    rids = worker.add_requests(prompts, p)
    outs = {}
    for _ in range(3):
        outs.update({o.request_id: o for o in worker.step()})
    assert worker.engine.stats()["spec_accepted"] > 0
    worker.update_weights(load_file(str(new / "model.safetensors")).items(), version=1)
    while len(outs) < len(rids):
        outs.update({o.request_id: o for o in worker.step()})
    fresh = cpu_engine(new)
    for rid, prompt, r in zip(rids, prompts, ref_old):
        c = outs[rid].completions[0]
        n0 = c.policy_versions.count(0)
        assert 0 < n0 < 40 and c.policy_versions == [0] * n0 + [1] * (40 - n0)
        assert c.token_ids[:n0] == r.completions[0].token_ids[:n0]
        assert_close(c.logprobs[:n0], r.completions[0].logprobs[:n0])
        cont = fresh.generate([prompt + c.token_ids[:n0]], SamplingParams(max_new_tokens=40 - n0, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)
        assert c.token_ids[n0:] == cont[0].completions[0].token_ids
        assert_close(c.logprobs[n0:], cont[0].completions[0].logprobs)
    assert_no_leak(worker.engine)


def test_switches_and_their_checks(model_dir, tiny_tokenizer):
    path = model_dir("llama")
    for bad in ({"speculative": "eagle"}, {"spec_max_draft": 0}, {"spec_min_acceptance": 1.5},
                {"spec_max_step_tokens": 1}, {"spec_history_prompts": -1}, {"spec_speed_gate": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            _spec(path, **bad)
    with pytest.raises(ValueError, match="speculative"):
        _spec(path).generate([[1, 2]], SamplingParams(speculative="no"), use_tqdm=False)
    prompts = _prompts(tiny_tokenizer, 2)
    p = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    off = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True, speculative=False)
    spec = _spec(path)
    spec.generate(prompts, p, use_tqdm=False)           # history: drafts would be found
    drafted = spec.stats()["spec_drafted"]
    assert drafted > 0
    spec.generate(prompts, off, use_tqdm=False)          # opted out: never drafted
    assert spec.stats()["spec_drafted"] == drafted
    assert "spec_drafted" not in cpu_engine(path).stats()
    # Too many rows for the memory-bound budget: 2 rows x (k + 1) > 3 tokens, so no drafted step.
    narrow = _spec(path, spec_max_step_tokens=3)
    narrow.generate(prompts, p, use_tqdm=False)
    narrow.generate(prompts, p, use_tqdm=False)
    assert narrow.stats()["spec_drafted"] == 0 and narrow.stats()["spec_drains"] == 0


def _decoding(n):
    seqs = [Request(i, [1, 2, 3], SamplingParams(), seed=0).seqs[0] for i in range(n)]
    for s in seqs:
        s.num_computed = 2                              # decoding: its last token is all it computes
    return seqs


def test_policy_k_by_rows_off_at_low_acceptance_then_probes():
    cfg = EngineConfig(speculative="ngram", spec_max_draft=4, spec_max_step_tokens=12, spec_min_acceptance=0.5,
                       spec_speed_gate=False)          # the gate is held to its own test below
    sp = Speculator(cfg)
    seqs = _decoding(4)
    assert [sp.draft_len(seqs[:n], 0.0) for n in (1, 2, 3, 4)] == [4, 4, 3, 2]   # rows x (k + 1) <= 12
    assert sp.draft_len(seqs * 2, 0.0) == 0             # 8 rows: k = 0, compute-bound
    seqs[0].num_computed = 1
    assert sp.draft_len(seqs[:1], 0.0) == 0             # nothing decoding (mid-prefill)
    for _ in range(10):
        sp.observe(10, 0, 2)                            # nothing accepted: acceptance 0.8 ** 10
    assert [sp.draft_len(seqs[1:], 0.0) for _ in range(PROBE_EVERY + 1)] == [0] * PROBE_EVERY + [3]
    sp.observe(10, 10, 2)                               # the probe accepted all: still below 0.5, wait again
    assert sp.acceptance < 0.5 and sp.draft_len(seqs[1:], 0.0) == 0
    assert sp.propose(seqs[1:], 3) == {} and sp.wait == 2   # no draft found: back off 2, 4, ... steps


def test_speed_gate_measures_plain_steps_then_drafts_only_while_faster():
    """Step times given: plain steps 1 ms; drafted steps gain 1 + 2 / 2 = 2 tokens per row, so they win
    at 1.5 ms and lose at 3 ms (the host-bound case: half the drafts accepted, and still slower) or 5 ms."""
    sp = Speculator(EngineConfig(speculative="ngram", spec_max_draft=4, spec_max_step_tokens=64))
    seqs, now = _decoding(2), [0.0]

    def steps(n, drafted_s, plain_s=1e-3):
        ks = []
        for _ in range(n):
            k = sp.draft_len(seqs, now[0])
            if k:
                sp.observe(2 * k, 2, 2)                 # 2 of 8 drafts accepted over the 2 rows
            now[0] += drafted_s if k else plain_s
            ks.append(k)
        return ks

    # No plain measurement yet: the first steps are plain, to measure it (the last 4 are measured: the
    # first follows a step that was not a plain decode).
    assert steps(CONTROL_STEPS + 1, 1.5e-3) == [0] * CONTROL_STEPS + [4]
    assert len(sp.rates["plain"]) == CONTROL_STEPS - 1
    assert steps(40, 1.5e-3) == [4] * 40
    assert sp.speedup() == pytest.approx(2 / 1.5e-3 / 1e3)   # the drafted rate over the plain one: 1.33
    # Drafted steps slow down: once 3 of the last 5 are slow (the median), back off PROBE_EVERY steps.
    ks = steps(3 + PROBE_EVERY + 2, 3e-3)
    assert ks[:3] == [4] * 3 and ks[3:3 + PROBE_EVERY] == [0] * PROBE_EVERY and ks[-2:] == [4, 4]
    assert sp.counts["spec_slower"] == 1 and sp.measured_speedup == pytest.approx(2 / 3e-3 / 1e3)
    # The probe is judged on its own samples (the faster ones from before the back-off are gone): its first
    # drafted step drained a plain batch (not measured), the next three are, still slow (x0.67): back off
    # again, twice as long.
    assert steps(3, 3e-3) == [4, 4, 0] and sp.counts["spec_slower"] == 2
    assert sp.measured_speedup == pytest.approx(2 / 3e-3 / 1e3) and sp.wait == 2 * PROBE_EVERY - 1
    # Faster again (a shrinking batch, say): the next probe's own samples keep drafting on at once.
    ks = steps(2 * PROBE_EVERY + 10, 1.5e-3)
    assert ks[:2 * PROBE_EVERY - 1] == [0] * (2 * PROBE_EVERY - 1) and ks[2 * PROBE_EVERY - 1:] == [4] * 11
    assert sp.counts["spec_slower"] == 2 and sp.speedup() > 1 and sp.slow_in_a_row == 0
    since = sp.since_plain
    ks = steps(REFRESH_STEPS + CONTROL_STEPS, 1.5e-3)
    # a step is measured when the next one starts (the first here measures the last one above), and the
    # step that measures the REFRESH_STEPS-th starts the control
    first = REFRESH_STEPS - since - 1
    assert ks.count(0) == CONTROL_STEPS and ks[first:first + CONTROL_STEPS] == [0] * CONTROL_STEPS
    assert sp.counts["spec_control_steps"] == 2 * CONTROL_STEPS
    # Under half the plain rate (drafted steps 5 ms: 0.4), one sample is enough to back off.
    sp = Speculator(EngineConfig(speculative="ngram", spec_max_draft=4, spec_max_step_tokens=64))
    assert steps(CONTROL_STEPS + 3, 5e-3) == [0] * CONTROL_STEPS + [4, 4, 0]
    assert sp.counts["spec_slower"] == 1 and sp.measured_speedup == pytest.approx(2 / 5e-3 / 1e3)
    # Slow at every probe (a host-bound model): the back-offs double up to MAX_SLOW_BACKOFF steps.
    waits = []
    for _ in range(5):
        wait = sp.wait
        waits.append(wait + 1)                          # the step that backed off took one of them
        assert steps(wait, 5e-3) == [0] * wait and steps(3, 5e-3) == [4, 4, 0]
    assert waits == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, MAX_SLOW_BACKOFF, MAX_SLOW_BACKOFF]


@pytest.mark.parametrize("slow", ["verify", "every_step"])
def test_speed_gate_in_the_engine(model_dir, tiny_tokenizer, slow):
    """The engine times its steps for the gate. A forward made slow only when it verifies drafts (a
    compute- or host-bound model) turns drafting off, with the tokens unchanged; a forward made slow on
    every step (memory-bound: a drafted step costs what a plain one does) keeps it on. The sleeps
    (0.1 s / 0.02 s) dwarf the tiny model's few-ms steps, so a loaded CI runner cannot flip the verdicts."""
    import time
    path = model_dir("llama")
    prompts = _prompts(tiny_tokenizer, 2)
    p = SamplingParams(n=2, max_new_tokens=48, temperature=0, ignore_eos=True)
    rows = len(prompts) * p.n

    def slowed(eng):
        run = eng.runner.run

        def timed(dev, *a, **kw):
            if slow == "every_step" or dev.num_rows > rows:     # more sampled rows than sequences: a verify
                time.sleep(0.1 if slow == "verify" else 0.02)
            return run(dev, *a, **kw)
        eng.runner.run = timed
        eng.generate(prompts, p, use_tqdm=False)         # the history the next round drafts from
        return eng.generate(prompts, p, use_tqdm=False), eng.stats()

    outs, st = slowed(_spec(path))
    assert_same(outs, cpu_engine(path).generate(prompts, p, use_tqdm=False))
    assert st["spec_control_steps"] >= CONTROL_STEPS and st["spec_accepted"] > 0
    if slow == "verify":
        assert st["spec_slower"] >= 1 and st["spec_measured_speedup"] < 1, st
        _, ungated = slowed(_spec(path, spec_speed_gate=False))
        # after the measured verdict only probes draft (7 drafted steps against 13 when measured)
        assert st["spec_steps"] < ungated["spec_steps"] and ungated["spec_slower"] == 0, (st, ungated)
    else:
        assert st["spec_slower"] == 0 and st["spec_measured_speedup"] > 1, st
