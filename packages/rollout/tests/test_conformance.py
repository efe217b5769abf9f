"""Conformance suite: every rollout backend (hf, vllm) passes these same tests on the tiny model.

References are computed from the HF model directly (``tools.logprobs``), never from an engine.
Each test that changes an engine's weights restores the base weights before returning.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from treadle.common.errors import BadRequest, Busy, EngineDead
from treadle.common.records import (
    CollectiveWeights,
    GenerateRequest,
    InlineWeights,
    SamplingParams,
    WeightGroupSpec,
)
from treadle.common.weights import WeightGroup, plan_buckets, tensor_nbytes
from treadle.rollout.engine import CanaryMismatch, WeightMismatch

PROMPTS = [np.array([5, 6, 7, 8, 9, 10, 11], dtype=np.int32), np.array([300, 17, 42], dtype=np.int32),
           np.arange(100, 130, dtype=np.int32)]
TOL = 1e-4  # fp32 logprob agreement with the HF model


def request(prompt, key="", **sampling) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=prompt, sampling=SamplingParams(**sampling), key=key)


async def collect(engine, req):
    return sorted([r async for r in engine.generate(req)], key=lambda r: r.index)


def run(s, req):
    return s.aio(collect(s.engine, req))


async def until_running(engine, timeout=10.0):
    """Wait until the engine reports a running sample (the request really started)."""
    for _ in range(int(timeout / 0.01)):
        if engine.stats().running > 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("request never started running")


def max_gap(model, results, prompt, tools, **proc) -> float:
    return max(float(np.abs(tools.logprobs(model, prompt, r.response_token_ids, **proc) - r.logprobs).max())
               for r in results)


# ---------------------------------------------------------------------------- sampling


def test_n_samples_have_indexes_and_metadata(subject):
    res = run(subject, request(PROMPTS[0], key="n4", n=4, temperature=1.0, max_tokens=6, seed=1))
    assert [r.index for r in res] == [0, 1, 2, 3]
    for r in res:
        assert (r.key, r.engine_id, r.weight_version) == ("n4", subject.engine.engine_id, subject.engine.weight_version)
        assert r.response_token_ids.dtype == np.int32 and r.logprobs.dtype == np.float32
        assert len(r.logprobs) == len(r.response_token_ids) == 6


def test_max_tokens_gives_length(subject):
    res = run(subject, request(PROMPTS[1], n=2, temperature=1.0, max_tokens=9, seed=2))
    assert [(len(r.response_token_ids), r.finish_reason) for r in res] == [(9, "length")] * 2


def test_stop_token_ends_sample_and_is_kept(subject):
    greedy = run(subject, request(PROMPTS[1], temperature=0.0, max_tokens=12))[0].response_token_ids
    stop = int(greedy[4])
    first = int(np.flatnonzero(greedy == stop)[0])
    r = run(subject, request(PROMPTS[1], temperature=0.0, max_tokens=12, stop_token_ids=[stop]))[0]
    assert r.finish_reason == "stop"
    assert r.response_token_ids.tolist() == greedy[:first + 1].tolist()


def test_min_tokens_masks_stop_tokens(subject, ref, tools):
    greedy = run(subject, request(PROMPTS[1], temperature=0.0, max_tokens=12))[0].response_token_ids
    stop = int(greedy[0])
    r = run(subject, request(PROMPTS[1], temperature=0.0, max_tokens=12, stop_token_ids=[stop], min_tokens=3))[0]
    assert stop not in r.response_token_ids[:3].tolist()
    assert r.finish_reason == "length" or (r.response_token_ids[-1] == stop and len(r.response_token_ids) > 3)


def test_greedy_is_deterministic_and_equal_across_backends(hf_engine, vllm_engine, ref, tools):
    for prompt in PROMPTS:
        req = request(prompt, temperature=0.0, max_tokens=24)
        outs = [run(s, req)[0] for s in (hf_engine, vllm_engine, hf_engine, vllm_engine)]
        tokens = [o.response_token_ids.tolist() for o in outs]
        assert tokens[0] == tokens[1] == tokens[2] == tokens[3]
        cross = float(np.abs(outs[0].logprobs - outs[1].logprobs).max())
        print(f"greedy hf vs vllm, prompt of {len(prompt)}: max |logprob gap| = {cross:.2e}")
        assert cross <= TOL
        assert max_gap(ref["a"], outs[:2], prompt, tools, temperature=0.0) <= TOL


def test_seeded_sampling_is_reproducible(subject):
    first = run(subject, request(PROMPTS[0], n=3, temperature=1.0, max_tokens=16, seed=123))
    again = run(subject, request(PROMPTS[0], n=3, temperature=1.0, max_tokens=16, seed=123))
    assert [r.response_token_ids.tolist() for r in first] == [r.response_token_ids.tolist() for r in again]
    assert all(np.allclose(a.logprobs, b.logprobs, atol=1e-6) for a, b in zip(first, again, strict=True))
    assert len({tuple(r.response_token_ids.tolist()) for r in first}) == 3  # samples differ
    # Sample i of seed s is sample 0 of seed s + i (vLLM's rule, followed by every backend).
    shifted = run(subject, request(PROMPTS[0], n=1, temperature=1.0, max_tokens=16, seed=124))[0]
    assert shifted.response_token_ids.tolist() == first[1].response_token_ids.tolist()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.9, 20, 0.8)])
def test_logprobs_match_hf_model(subject, ref, tools, temperature, top_k, top_p):
    async def all_prompts():  # concurrently: the HF engine batches them, left-padded
        reqs = [request(p, n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=24, seed=5)
                for p in PROMPTS]
        return await asyncio.gather(*(collect(subject.engine, q) for q in reqs))

    outs = subject.aio(all_prompts())
    gap = max(max_gap(ref["a"], res, p, tools, temperature=temperature, top_k=top_k, top_p=top_p)
              for p, res in zip(PROMPTS, outs, strict=True))
    print(f"{subject.name} T={temperature} top_k={top_k} top_p={top_p}: max |logprob gap| = {gap:.2e}")
    assert gap <= TOL


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, -1, 1.0), (0.8, -1, 1.0), (1.0, 3, 1.0), (0.9, -1, 0.6)])
def test_top_logprobs_are_the_sampling_distributions_top_k(subject, ref, tools, temperature, top_k, top_p):
    """top_logprobs=k: per token the k most likely tokens of the distribution it was drawn from,
    most likely first, equal to log_softmax of the HF model's processed logits; the sampled token's
    own entry equals its logprob whenever it is among them; asking changes no sampled token."""
    k, n = 5, 1 if temperature == 0 else 2
    kw = dict(n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=10, seed=7)
    res = run(subject, request(PROMPTS[0], top_logprobs=k, **kw))
    plain = run(subject, request(PROMPTS[0], **kw))
    assert plain[0].top_token_ids is None and plain[0].top_logprobs is None  # not asked: nothing on the wire
    seen_inside = 0
    for r, p in zip(res, plain, strict=True):
        assert r.response_token_ids.tolist() == p.response_token_ids.tolist()
        ids, lps = r.top_token_ids, r.top_logprobs
        assert ids.dtype == np.int32 and lps.dtype == np.float32 and ids.shape == lps.shape == (10, k)
        assert (lps[:, :-1] >= lps[:, 1:]).all()  # sorted, most likely first (-inf >= -inf holds)
        want = tools.distributions(ref["a"], PROMPTS[0], r.response_token_ids, temperature, top_k, top_p).numpy()
        for t, tok in enumerate(r.response_token_ids.tolist()):
            best = np.sort(want[t])[::-1][:k]
            finite = np.isfinite(best)
            assert (np.isfinite(lps[t]) == finite).all(), (t, lps[t], best)  # -inf where top-k / top-p cut
            assert np.abs(lps[t][finite] - best[finite]).max() <= TOL
            assert np.abs(want[t][ids[t][finite]] - lps[t][finite]).max() <= TOL  # the ids carry those values
            assert len(set(ids[t][finite].tolist())) == int(finite.sum())
            if tok in ids[t].tolist():
                seen_inside += 1
                assert abs(lps[t][ids[t].tolist().index(tok)] - r.logprobs[t]) <= 1e-5
            else:
                assert want[t][tok] <= lps[t][-1] + TOL  # left out only when k others are at least as likely
    if temperature == 0 or 0 < top_k <= k:  # the sampled token is one of the k most likely: always listed
        assert seen_inside == sum(len(r.response_token_ids) for r in res)
    if temperature == 0:
        assert all(r.top_token_ids[:, 0].tolist() == r.response_token_ids.tolist() for r in res)


def test_top_logprobs_above_the_limit_are_refused():
    with pytest.raises(ValueError, match="top_logprobs must be in \\[0, 20\\]"):
        SamplingParams(top_logprobs=21)
    with pytest.raises(ValueError, match="needs logprobs=True"):
        SamplingParams(top_logprobs=2, logprobs=False)


def test_prompt_logprobs_match_hf_model(subject, ref, tools):
    want = tools.prompt_logprobs(ref["a"], PROMPTS[2])
    got = subject.aio(subject.engine.prompt_logprobs(PROMPTS[2]))
    assert got.shape == (len(PROMPTS[2]) - 1,) and np.abs(got - want).max() <= TOL
    res = run(subject, request(PROMPTS[2], n=2, temperature=1.0, max_tokens=3, seed=0, prompt_logprobs=True))
    assert all(np.abs(r.prompt_logprobs - want).max() <= TOL for r in res)


def test_prompt_logprobs_at_a_temperature_are_the_scaled_models_or_refused(subject, ref):
    """A reference scored at the sampling temperature (``--ref.remote_url``): the hf backend divides
    the logits by it; vLLM scores raw logits, so it refuses any temperature but 1, naming it."""
    import torch

    ids = torch.as_tensor(np.asarray(PROMPTS[2], dtype=np.int64))[None]
    with torch.no_grad():
        lp = torch.log_softmax(ref["a"](ids).logits[0, :-1].double() / 0.7, -1)
    want = lp.gather(1, ids[0, 1:, None]).squeeze(1).numpy()
    if subject.engine.scores_at_temperature:
        got = subject.aio(subject.engine.prompt_logprobs(PROMPTS[2], 0.7))
        assert np.abs(got - want).max() <= TOL
    else:
        with pytest.raises(BadRequest, match="asked for 0.7"):
            subject.aio(subject.engine.prompt_logprobs(PROMPTS[2], 0.7))
    with pytest.raises(BadRequest, match="temperature 0"):
        subject.aio(subject.engine.prompt_logprobs(PROMPTS[2], 0.0))


def test_prompt_logprobs_asked_together_equal_each_alone(subject, ref, tools):
    """Sequences scored at once (a reference daemon's micro-batch: the hf backend pads them into
    one forward) get each its own log-probs, whatever their lengths."""
    async def together():
        return await asyncio.gather(*(subject.engine.prompt_logprobs(p) for p in PROMPTS))

    got = subject.aio(together())
    for p, lp in zip(PROMPTS, got, strict=True):
        assert lp.shape == (len(p) - 1,) and np.abs(lp - tools.prompt_logprobs(ref["a"], p)).max() <= TOL


def test_abort_stops_request(subject):
    async def scenario():
        task = asyncio.create_task(collect(subject.engine, request(
            PROMPTS[0], key="abort-me", n=2, temperature=1.0, max_tokens=1800, seed=3)))
        await until_running(subject.engine)
        n = await subject.engine.abort("abort-me")
        return n, await task, await subject.engine.abort("no-such-key")

    n, res, none = subject.aio(scenario())
    assert n == 2 and none == 0
    assert [r.finish_reason for r in res] == ["abort", "abort"]
    assert all(len(r.response_token_ids) < 1800 for r in res)
    assert run(subject, request(PROMPTS[1], max_tokens=4))[0].finish_reason == "length"


def test_stats_count_tokens(subject):
    before = subject.engine.stats()
    run(subject, request(PROMPTS[1], n=3, temperature=1.0, max_tokens=5, seed=9))
    after = subject.engine.stats()
    assert after.tokens_generated - before.tokens_generated == 15
    assert after.samples_finished - before.samples_finished == 3
    assert (after.running, after.waiting, after.paused) == (0, 0, False) and after.tokens_per_s > 0
    assert after.as_dict()["backend"] == subject.name


def test_bad_requests_are_refused(subject):
    e = subject.engine
    cases = [(BadRequest, request(np.array([e.vocab_size], dtype=np.int32))),
             (BadRequest, request(PROMPTS[0], max_tokens=e.max_model_len)),
             (BadRequest, request(PROMPTS[0], n=2, temperature=0.0)),
             (BadRequest, request(PROMPTS[0], stop_token_ids=[-1])),
             (Busy, GenerateRequest(prompt_token_ids=PROMPTS[0], min_version=e.weight_version + 1))]
    for exc, req in cases:
        with pytest.raises(exc):
            run(subject, req)
    assert run(subject, request(PROMPTS[1], max_tokens=2))[0].finish_reason == "length"


def test_reset_prefix_cache_keeps_outputs(subject):
    req = request(PROMPTS[2], temperature=0.0, max_tokens=8)
    before = run(subject, req)[0].response_token_ids.tolist()
    subject.aio(subject.engine.reset_prefix_cache())
    assert run(subject, req)[0].response_token_ids.tolist() == before


def test_sleep_pauses_and_wake_resumes(subject):
    async def scenario():
        state = await subject.engine.sleep(1)
        stats = subject.engine.stats()
        task = asyncio.create_task(collect(subject.engine, request(PROMPTS[1], max_tokens=3)))
        await asyncio.sleep(0.3)
        held = not task.done()
        await subject.engine.wake()
        return state, stats, held, await task

    state, stats, held, res = subject.aio(scenario())
    assert stats.sleeping and stats.paused and held and res[0].finish_reason == "length"
    assert state.level == 1 and state.note
    if not state.memory_released:  # CPU: sleep degrades to a pause, and says so
        assert "paused" in state.note


# ---------------------------------------------------------------------------- weights


def test_update_weights_serves_exactly_the_new_weights(subject, ref, tools):
    v0 = subject.engine.weight_version
    try:
        assert subject.update(tools.checkpoint(subject.model_b)) == v0 + 1
        got = subject.aio(subject.engine.prompt_logprobs(PROMPTS[2]))
        assert np.abs(got - tools.prompt_logprobs(ref["b"], PROMPTS[2])).max() <= TOL
        res = run(subject, request(PROMPTS[0], n=2, temperature=1.0, max_tokens=16, seed=4))
        assert {r.weight_version for r in res} == {v0 + 1}
        assert max_gap(ref["b"], res, PROMPTS[0], tools) <= TOL
    finally:
        subject.restore()
    got = subject.aio(subject.engine.prompt_logprobs(PROMPTS[2]))
    assert np.abs(got - tools.prompt_logprobs(ref["a"], PROMPTS[2])).max() <= TOL
    assert subject.engine.weight_version == v0 + 2


def _corrupt(base, how):
    import torch

    t = dict(base)
    name = "model.layers.1.mlp.down_proj.weight"
    if how == "name":
        t["model.layers.9.mlp.down_proj.weight"] = t.pop(name)
    elif how == "shape":
        t[name] = t[name][:, :-1].contiguous()
    elif how == "dtype":
        t[name] = t[name].to(torch.bfloat16)
    elif how == "missing":
        del t[name]
    return t


@pytest.mark.parametrize("how", ["name", "shape", "dtype", "missing"])
def test_bad_update_is_refused_and_engine_keeps_serving(subject, ref, tools, how):
    v0 = subject.engine.weight_version
    with pytest.raises(WeightMismatch, match="down_proj"):
        subject.update(_corrupt(subject.base, how))
    assert subject.engine.weight_version == v0 and not subject.engine.stats().broken
    got = subject.aio(subject.engine.prompt_logprobs(PROMPTS[2]))
    assert np.abs(got - tools.prompt_logprobs(ref["a"], PROMPTS[2])).max() <= TOL


def test_a_header_that_passed_is_not_checked_again_but_any_other_is(subject):
    engine = subject.engine

    def update(tensors):
        return CollectiveWeights(version=engine.weight_version + 1, names=list(tensors),
                                 dtypes=["float32"] * len(tensors), shapes=[list(t.shape) for t in tensors.values()])

    good = update(subject.base)
    engine.check_update(good)
    assert engine._checked == (good.names, good.dtypes, good.shapes, None)  # kept (no adapter): not walked again
    engine.check_update(update(subject.base))
    for how in ("name", "shape", "missing"):
        with pytest.raises(WeightMismatch, match="down_proj"):
            engine.check_update(update(_corrupt(subject.base, how)))
        assert engine._checked == (good.names, good.dtypes, good.shapes, None)  # a refused header is not kept


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_in_flight_samples_never_mix_versions(subject, ref, tools, mode):
    v0 = subject.engine.weight_version
    b = tools.checkpoint(subject.model_b)
    upd = InlineWeights(version=v0 + 1, names=list(b), dtypes=["float32"] * len(b),
                        shapes=[list(x.shape) for x in b.values()], tensors=list(b.values()))

    async def scenario():
        old = asyncio.create_task(collect(subject.engine, request(PROMPTS[0], temperature=1.0, max_tokens=300, seed=8)))
        await until_running(subject.engine)
        await subject.engine.update_weights(upd, mode=mode)
        new = await collect(subject.engine, request(PROMPTS[0], temperature=1.0, max_tokens=8, seed=8))
        return await old, new

    try:
        (old,), (new,) = subject.aio(scenario())
    finally:
        subject.restore()
    assert old.weight_version == v0 and new.weight_version == v0 + 1
    assert old.finish_reason == ("length" if mode == "wait" else "abort")
    assert max_gap(ref["a"], [old], PROMPTS[0], tools) <= TOL  # every token from the old weights
    assert max_gap(ref["b"], [new], PROMPTS[0], tools) <= TOL


def test_canary_accepts_right_weights_and_flags_wrong_ones(subject, ref, tools):
    b = tools.checkpoint(subject.model_b)
    canary = PROMPTS[2]
    try:
        subject.update(b, canary_token_ids=canary, canary_logprobs=tools.prompt_logprobs(ref["b"], canary).astype(np.float32))
        with pytest.raises(CanaryMismatch, match="canary"):
            subject.update(subject.base, canary_token_ids=canary,
                           canary_logprobs=tools.prompt_logprobs(ref["b"], canary).astype(np.float32))
        assert subject.engine.stats().broken
        with pytest.raises(EngineDead):
            run(subject, request(PROMPTS[1], max_tokens=2))
    finally:
        subject.restore()
    assert not subject.engine.stats().broken
    assert run(subject, request(PROMPTS[1], max_tokens=2))[0].finish_reason == "length"


def joined_sender(subject, tools) -> WeightGroup:
    """The sender's side (rank 0) of a new group of two, the engine joined as rank 1."""
    spec = WeightGroupSpec(host="127.0.0.1", port=tools.free_port(), world_size=2, rank=0, timeout_s=60)
    sender: list[WeightGroup] = []
    joining = threading.Thread(target=lambda: sender.append(WeightGroup(spec)))
    joining.start()
    subject.aio(subject.engine.join_weight_group(spec.with_rank(1)))
    joining.join(30)
    return sender[0]


def test_collective_receive_is_bit_identical(subject, ref, tools):
    b = tools.checkpoint(subject.model_b)
    names, tensors = list(b), list(b.values())
    sender = [joined_sender(subject, tools)]

    def broadcast(update, ts):
        t = threading.Thread(target=tools.send_buckets, args=(sender[0], ts, update.bucket_sizes))
        t.start()
        return t

    def collective(version, dtypes):
        return CollectiveWeights(version=version, names=names, dtypes=dtypes, shapes=[list(x.shape) for x in tensors],
                                 bucket_sizes=plan_buckets([tensor_nbytes(d, x.shape) for d, x in zip(dtypes, tensors, strict=True)], 64 << 10))

    v0 = subject.engine.weight_version
    base_digest = subject.aio(subject.engine.weight_digest())
    try:
        upd = collective(v0 + 1, ["float32"] * len(names))
        t = broadcast(upd, tensors)
        assert subject.aio(subject.engine.receive_weights(upd)) == v0 + 1
        t.join(30)
        received = subject.aio(subject.engine.weight_digest())
        got = subject.aio(subject.engine.prompt_logprobs(PROMPTS[2]))
        assert np.abs(got - tools.prompt_logprobs(ref["b"], PROMPTS[2])).max() <= TOL
        # A refused header is drained from the group: the sender finishes, the engine serves on.
        bad = collective(v0 + 2, ["bfloat16"] * len(names))
        t = broadcast(bad, [x.bfloat16() for x in tensors])
        with pytest.raises(WeightMismatch, match="bfloat16"):
            subject.aio(subject.engine.receive_weights(bad))
        t.join(30)
        assert not t.is_alive() and subject.engine.weight_version == v0 + 1
        subject.update(b)  # the same weights inline: the same bytes must end up in the engine
        assert subject.aio(subject.engine.weight_digest()) == received != base_digest
    finally:
        subject.aio(subject.engine.leave_weight_group())
        sender[0].close()
        subject.restore()

