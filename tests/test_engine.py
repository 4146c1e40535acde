"""The built-in engine against transformers on a tiny random Qwen2: tokens, logprobs, control."""

import asyncio
import json
import shutil
import time

import pytest
import torch
import transformers

from asyncrl.api import (
    GenerationConfig,
    InferenceEngine,
    ModelRequest,
    ModelResponse,
    StopReason,
    WeightUpdateMeta,
)
from asyncrl.inference import kernels
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.inference.linear import KernelMatmuls, OneDNNMatmuls
from asyncrl.inference.model_runner import iter_safetensors

VOCAB = 128
LENGTHS = [3, 8, 17, 30, 5, 12]


def tiny_config():
    return transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=768, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2")
    transformers.Qwen2ForCausalLM(tiny_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.Qwen2ForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts):
    with torch.inference_mode():
        return [
            hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24)[0, len(p):].tolist()
            for p in prompts
        ]


pytestmark = pytest.mark.usefixtures("one_thread")


def engine_config(model_dir, **kw) -> EngineConfig:
    """The CPU engine in fp32: these tests check its exactness (atol 1e-4) and its CPU kernels,
    also on a CUDA machine; the CUDA engine's checks are in tests/test_engine_device.py."""
    kw.setdefault("max_seq_len", 128)
    kw.setdefault("device", "cpu")
    return EngineConfig(model_path=str(model_dir), **kw)


def make_engine(model_dir, **kw):
    return LLMEngine(engine_config(model_dir, **kw))


def greedy(n=24, **kw):
    return GenerationConfig(max_new_tokens=n, greedy=True, **kw)


def full_logprobs(model, prompt, output, temperature):
    """log_softmax(logits / T) of each output token under one full forward pass."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0]


def assert_logprobs(model, prompt, out, temperature=1.0):
    ref = full_logprobs(model, prompt, out.output_tokens, temperature)
    got = torch.tensor(out.output_logprobs)
    assert torch.allclose(got, ref, atol=1e-4), (got, ref)


async def wait_for_stats(engine, ready, timeout=30.0):
    """Poll `engine.stats()` until `ready(stats)` holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ready(stats := engine.stats()):
        assert time.monotonic() < deadline, f"engine never reached the state; last stats {stats}"
        await asyncio.sleep(0.01)


def assert_prefix(tokens, ref):
    """A run cut short agrees with the reference as far as both go (the engine may have passed
    the reference's 24 tokens before the cut)."""
    n = min(len(tokens), len(ref))
    assert tokens[:n] == ref[:n]


def test_greedy_batch_matches_hf_generate(model_dir, hf, prompts, hf_greedy):
    eng = make_engine(model_dir, max_num_seqs=8)
    outs = eng.generate([ModelRequest(p, greedy()) for p in prompts])
    assert [o.output_tokens for o in outs] == hf_greedy
    for p, o in zip(prompts, outs):  # catches masking errors too small to flip an argmax
        assert_logprobs(hf, p, o)
    assert all(o.stop_reason == StopReason.LENGTH and o.output_versions == [0] * 24 for o in outs)
    assert all(0 < o.ttft <= o.latency for o in outs)


def test_staggered_arrivals_and_more_requests_than_slots(model_dir, hf, prompts, hf_greedy):
    """3 slots, 6 requests arriving over time with different lengths: joins, moves, all finish."""
    eng = make_engine(model_dir, max_num_seqs=3)
    budgets = [24, 7, 13, 24, 3, 19]
    reqs = [ModelRequest(p, greedy(n)) for p, n in zip(prompts, budgets)]
    done = {}
    for step in range(400):
        if step % 4 == 0 and step // 4 < len(reqs):
            eng.add_request(reqs[step // 4])
        done.update((r.rid, r) for r in eng.step())
        if len(done) == len(reqs):
            break
    for req, n, ref in zip(reqs, budgets, hf_greedy):
        assert done[req.rid].output_tokens == ref[:n]
        assert_logprobs(hf, req.input_ids, done[req.rid])


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_logprobs_match_full_forward(model_dir, hf, prompts, temperature):
    eng = make_engine(model_dir, max_num_seqs=4)
    gc = GenerationConfig(max_new_tokens=20, temperature=temperature, top_p=0.9, top_k=40)
    outs = eng.generate([ModelRequest(p, gc) for p in prompts])
    for p, o in zip(prompts, outs):
        assert_logprobs(hf, p, o, temperature)
    assert len({t for o in outs for t in o.output_tokens}) > 20  # really sampled, not one token


def test_stop_token_ids_min_and_max_new_tokens(model_dir, prompts, hf_greedy):
    eng = make_engine(model_dir)
    ref = hf_greedy[0]
    stop = ref[5]
    first = ref.index(stop)
    out = eng.generate([ModelRequest(prompts[0], greedy(stop_token_ids=[stop]))])[0]
    assert out.stop_reason == StopReason.STOP and out.output_tokens == ref[: first + 1]
    # A stop token cannot end the output before min_new_tokens; later it still can.
    hot = list(range(0, VOCAB, 2))  # half the vocabulary stops
    gc = GenerationConfig(
        max_new_tokens=40, min_new_tokens=10, temperature=1.0, stop_token_ids=hot, seed=3
    )
    out = eng.generate([ModelRequest(prompts[1], gc)])[0]
    assert not set(out.output_tokens[:10]) & set(hot)
    assert out.stop_reason == StopReason.STOP and out.output_tokens[-1] in hot
    out = eng.generate([ModelRequest(prompts[1], greedy(5))])[0]
    assert out.stop_reason == StopReason.LENGTH and len(out.output_tokens) == 5


def test_eos_from_model_config_and_ignore_eos(model_dir, prompts, hf_greedy, tmp_path):
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    cfg = json.loads((eos_dir / "config.json").read_text())
    cfg["eos_token_id"] = hf_greedy[2][3]
    (eos_dir / "config.json").write_text(json.dumps(cfg))
    (eos_dir / "generation_config.json").unlink()
    out = make_engine(eos_dir).generate([ModelRequest(prompts[2], greedy())])[0]
    assert out.stop_reason == StopReason.STOP
    assert out.output_tokens == hf_greedy[2][: hf_greedy[2].index(cfg["eos_token_id"]) + 1]
    out = make_engine(eos_dir, ignore_eos=True).generate([ModelRequest(prompts[2], greedy())])[0]
    assert out.output_tokens == hf_greedy[2]


def test_stop_strings_through_detokenize_callback(model_dir, prompts, hf_greedy):
    def detok(ids):
        return "".join(chr(65 + t % 26) for t in ids)

    text = detok(hf_greedy[3])
    eng = LLMEngine(engine_config(model_dir), detokenize=detok)
    out = eng.generate([ModelRequest(prompts[3], greedy(stop=[text[6:9]]))])[0]
    assert out.stop_reason == StopReason.STOP
    assert detok(out.output_tokens).endswith(text[6:9]) and len(out.output_tokens) <= 9


def test_same_seed_same_sample(model_dir, prompts):
    gc = GenerationConfig(max_new_tokens=16, temperature=1.0, seed=42)
    alone = make_engine(model_dir).generate([ModelRequest(prompts[0], gc)])[0]
    crowd = make_engine(model_dir, seed=7).generate(
        [ModelRequest(p, GenerationConfig(max_new_tokens=16)) for p in prompts[1:3]]
        + [ModelRequest(prompts[0], gc)]
    )[-1]
    other = make_engine(model_dir).generate([ModelRequest(prompts[0], gc.replace(seed=43))])[0]
    assert alone.output_tokens == crowd.output_tokens
    assert alone.output_tokens != other.output_tokens


def test_abort_returns_partial_output(model_dir, prompts, hf_greedy):
    eng = make_engine(model_dir, max_num_seqs=2)
    reqs = [ModelRequest(p, greedy()) for p in prompts[:3]]  # the third waits for a slot
    for r in reqs:
        eng.add_request(r)
    for _ in range(5):
        assert eng.step() == []
    (out,) = eng.abort(reqs[0].rid)
    assert out.stop_reason == StopReason.ABORT and out.output_tokens == hf_greedy[0][:5]
    eng.pause()
    assert eng.step() == []  # paused: nothing is scheduled
    eng.resume()
    eng.step()  # a prefill-only step: the waiting request joins, the running one does not move
    rest = {o.rid: o for o in eng.abort()}
    assert rest[reqs[1].rid].output_tokens == hf_greedy[1][:5]
    assert rest[reqs[2].rid].output_tokens == hf_greedy[2][:1]
    assert not eng.has_unfinished() and eng.abort() == []


def perturbed_state_dict(hf, scale=0.05):
    g = torch.Generator().manual_seed(5)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in hf.state_dict().items()}


def test_weight_update_mid_stream(model_dir, hf, prompts, hf_greedy, tmp_path):
    eng = make_engine(model_dir)
    req = ModelRequest(prompts[1], greedy())
    eng.add_request(req)
    for _ in range(6):
        eng.step()
    new_sd = perturbed_state_dict(hf)
    eng.update_weights_from_state_dict(new_sd, version=1)
    done = []
    while eng.has_unfinished():
        done += eng.step()
    (out,) = done
    assert out.output_versions == [0] * 6 + [1] * 18
    assert out.output_tokens[:6] == hf_greedy[1][:6]
    new = transformers.Qwen2ForCausalLM(tiny_config()).eval()
    new.load_state_dict(new_sd)
    assert out.output_tokens != hf_greedy[1]
    # Later tokens are exactly the new policy's (greedy continuation and temperature-1 logprobs).
    lp_new = full_logprobs(new, prompts[1], out.output_tokens, 1.0)
    lp_old = full_logprobs(hf, prompts[1], out.output_tokens, 1.0)
    got = torch.tensor(out.output_logprobs)
    assert torch.allclose(got[6:], lp_new[6:], atol=1e-4)
    assert torch.allclose(got[:6], lp_old[:6], atol=1e-4)
    # From disk: the same weights saved as an HF directory, a new version.
    new.save_pretrained(tmp_path / "v2")
    eng.update_weights_from_state_dict(iter_safetensors(tmp_path / "v2"), version=2)
    out2 = eng.generate([ModelRequest(prompts[1], greedy())])[0]
    assert out2.output_versions == [2] * 24
    with torch.inference_mode():
        ref = new.generate(torch.tensor([prompts[1]]), do_sample=False, max_new_tokens=24)
    assert out2.output_tokens == ref[0, len(prompts[1]):].tolist()


def test_bad_weight_update_keeps_old_weights(model_dir, hf, prompts, hf_greedy):
    eng = make_engine(model_dir)
    bad = perturbed_state_dict(hf)
    bad["model.norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match="model.norm.weight"):
        eng.update_weights_from_state_dict(bad, version=3)
    with pytest.raises(ValueError, match="missing"):
        eng.update_weights_from_state_dict({"model.norm.weight": torch.ones(256)}, version=3)
    assert eng.version == 0
    assert eng.generate([ModelRequest(prompts[0], greedy())])[0].output_tokens == hf_greedy[0]


def test_bad_inputs_raise_value_error(model_dir):
    eng = make_engine(model_dir, max_seq_len=64)
    with pytest.raises(ValueError, match="empty"):
        ModelRequest([])
    req = ModelRequest([1, 2])
    req.input_ids.clear()
    with pytest.raises(ValueError, match="empty"):
        eng.add_request(req)
    with pytest.raises(ValueError, match=r"\[128\].*allowed \[0, 127\]"):
        eng.add_request(ModelRequest([5, 128]))
    with pytest.raises(ValueError, match=r"\[-1\]"):
        eng.add_request(ModelRequest([-1]))
    with pytest.raises(ValueError, match=r"stop_token_ids.*\[200\]"):
        eng.add_request(ModelRequest([1], greedy(4, stop_token_ids=[200])))
    with pytest.raises(ValueError, match="max_seq_len=64"):
        eng.add_request(ModelRequest([1] * 10, GenerationConfig(max_new_tokens=55)))
    with pytest.raises(ValueError, match="n_samples=2"):
        eng.add_request(ModelRequest([1], GenerationConfig(n_samples=2)))
    with pytest.raises(ValueError, match="detokenize"):
        eng.add_request(ModelRequest([1], GenerationConfig(max_new_tokens=4, stop=["x"])))
    eng.add_request(ModelRequest([1], greedy(4), rid="dup"))
    with pytest.raises(ValueError, match="dup"):
        eng.add_request(ModelRequest([2], greedy(4), rid="dup"))
    with pytest.raises(ValueError, match="max_seq_len=2048"):
        make_engine(model_dir, max_seq_len=2048)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        make_engine(model_dir, kv_cache_bytes=1000)
    # 8 layers * 2 (k, v) * 2 kv heads * 128 positions * 64 dims * 4 bytes = 1 MiB per slot
    assert make_engine(model_dir, kv_cache_bytes=3 * 2**20 + 5).scheduler.num_slots == 3


def test_hf_fallback_backend_matches(model_dir, prompts, hf_greedy):
    eng = make_engine(model_dir, backend="hf", max_num_seqs=4)
    outs = eng.generate([ModelRequest(p, greedy(8)) for p in prompts[:3]])
    assert [o.output_tokens for o in outs] == [r[:8] for r in hf_greedy[:3]]


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_bfloat16_runs(model_dir, prompts, hf_greedy, cpu_kernels):
    eng = make_engine(model_dir, dtype="bfloat16", cpu_kernels=cpu_kernels)
    outs = eng.generate([ModelRequest(p, greedy(8)) for p in prompts])
    assert all(len(o.output_tokens) == 8 for o in outs)
    same = sum(o.output_tokens[0] == r[0] for o, r in zip(outs, hf_greedy))
    assert same >= len(prompts) // 2  # bf16 rounding may flip near-ties, not most first tokens


def test_async_engine_protocol_pause_and_updates(model_dir, hf, prompts, hf_greedy, tmp_path):
    async def main(engine):
        outs = await asyncio.gather(*(engine.agenerate(ModelRequest(p, greedy())) for p in prompts))
        assert [o.output_tokens for o in outs] == hf_greedy
        with pytest.raises(ValueError, match="n_samples"):
            await engine.agenerate(ModelRequest(prompts[0], GenerationConfig(n_samples=4)))
        # pause aborts what is in flight; requests made while paused wait for resume. Paused at
        # its first streamed tokens: a fast machine generates all 90 within any fixed sleep.
        stream = engine.agenerate_stream(ModelRequest(prompts[0], greedy(90)))
        first = await anext(stream)
        engine.pause()
        async for aborted in stream:
            pass
        assert not isinstance(first, ModelResponse)
        assert aborted.stop_reason == StopReason.ABORT and aborted.output_len < 90
        assert_prefix(aborted.output_tokens, hf_greedy[0])
        queued = asyncio.ensure_future(engine.agenerate(ModelRequest(prompts[1], greedy(4))))
        await asyncio.sleep(0.05)
        assert not queued.done()
        new_sd = perturbed_state_dict(hf)
        await engine.update_weights(WeightUpdateMeta.from_tensors(version=1), new_sd)
        assert engine.get_version() == 1
        engine.resume()
        out = await queued
        assert out.output_versions == [1] * 4 and out.output_tokens != hf_greedy[1][:4]
        hf.save_pretrained(tmp_path / "orig")
        await engine.update_weights(WeightUpdateMeta.from_disk(str(tmp_path / "orig"), version=2))
        out = await engine.agenerate(ModelRequest(prompts[1], greedy()))
        assert out.output_tokens == hf_greedy[1] and out.output_versions == [2] * 24
        with pytest.raises(ValueError, match="`weights`"):
            await engine.update_weights(WeightUpdateMeta.from_tensors(version=3))

    with AsyncLLMEngine(engine_config(model_dir)) as engine:
        assert isinstance(engine, InferenceEngine)
        asyncio.run(main(engine))


def test_async_stream_abort_cancel_and_stats(model_dir, prompts, hf_greedy):
    async def main(engine):
        items = [it async for it in engine.agenerate_stream(ModelRequest(prompts[2], greedy(10)))]
        final = items[-1]
        assert isinstance(final, ModelResponse) and final.output_tokens == hf_greedy[2][:10]
        streamed = [t for it in items[:-1] for t in it.output_tokens]
        # One delta per step; the finishing step's token comes only with the final response.
        assert streamed == final.output_tokens[:-1] and len(items) == 10
        # A cancelled caller frees its slot; abort(rid) answers the waiting caller with ABORT.
        # Generations are long (900 tokens) so neither can finish before the cut, and the test
        # waits for states, never a fixed time (CI machines differ in speed).
        slow = asyncio.ensure_future(engine.agenerate(ModelRequest(prompts[0], greedy(900))))
        other = asyncio.ensure_future(
            engine.agenerate(ModelRequest(prompts[1], greedy(900), rid="x"))
        )
        await wait_for_stats(engine, lambda s: s["running"] == 2)
        slow.cancel()
        assert await asyncio.to_thread(engine.abort, "x") == 1
        out = await other
        assert out.stop_reason == StopReason.ABORT and len(out.output_tokens) < 900
        assert_prefix(out.output_tokens, hf_greedy[1])
        await wait_for_stats(engine, lambda s: s["running"] == 0 and s["waiting"] == 0)
        assert engine.stats()["kv_cache_usage"] == 0.0

    with AsyncLLMEngine(engine_config(model_dir, max_seq_len=1024)) as engine:
        asyncio.run(main(engine))


@pytest.mark.parametrize(
    ("fast", "cpu_kernels"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_wide_decode_batch_logprobs(model_dir, hf, fast, cpu_kernels):
    """24 rows through every matmul path (C++ kernels, oneDNN, plain torch) and both attention
    paths (C++ kernels, torch): each matches a full forward pass."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 20, (24,), generator=g).tolist()
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    eng = make_engine(model_dir, max_num_seqs=24, fast_matmuls=fast, cpu_kernels=cpu_kernels)
    model, built = eng.runner.model, kernels.load() is not None
    assert (model._kernels is not None) == (cpu_kernels and built)
    expected = None
    if fast:
        expected = KernelMatmuls if cpu_kernels and built else OneDNNMatmuls
    if expected is None:
        assert model._fast is None
    else:
        assert isinstance(model._fast, expected)
    gc = GenerationConfig(max_new_tokens=6, temperature=0.8)
    outs = eng.generate([ModelRequest(p, gc) for p in prompts])
    for p, o in zip(prompts, outs):
        assert_logprobs(hf, p, o, 0.8)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(model_dir):
    """An engine step that raises (a request it cannot serve, a transient device error) ends the
    unfinished requests with EngineStepError; the next request is served as usual."""
    from asyncrl.inference.async_engine import EngineStepError

    engine = AsyncLLMEngine(engine_config(model_dir))
    real_step, calls = engine.engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step()

    engine.engine.step = flaky_step

    async def main():
        with pytest.raises(EngineStepError, match="illegal memory access"):
            await engine.agenerate(ModelRequest([1, 2, 3], greedy(4)))
        return await engine.agenerate(ModelRequest([1, 2, 3], greedy(4)))

    try:
        out = asyncio.run(main())
    finally:
        engine.shutdown()
    assert out.output_len == 4 and out.stop_reason == StopReason.LENGTH


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_fails_callers_and_control_calls_instead_of_hanging(model_dir):
    """Steps that fail MAX_FAILED_STEPS times in a row stop the engine thread: the caller then
    waiting and every later control call (pause, abort) get EngineDeadError, none waits."""
    from asyncrl.inference.async_engine import MAX_FAILED_STEPS, EngineDeadError, EngineStepError

    engine = AsyncLLMEngine(engine_config(model_dir))

    def broken_step():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.engine.step = broken_step

    async def main():
        for _ in range(MAX_FAILED_STEPS - 1):
            with pytest.raises(EngineStepError):
                await engine.agenerate(ModelRequest([1, 2, 3], greedy(4)))
        with pytest.raises(EngineDeadError, match="illegal memory access"):
            await engine.agenerate(ModelRequest([1, 2, 3], greedy(4)))

    asyncio.run(main())
    with pytest.raises(EngineDeadError):
        engine.pause()
    with pytest.raises(EngineDeadError):
        engine.abort()
