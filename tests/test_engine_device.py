"""The engine's device: settings and their validation, no tensor on an implicit device, the CUDA
KV cache budget, the launch-time placement check, and (marker `gpu`) CUDA against transformers.

What the CPU proves about CUDA: the engine runs under `torch.set_default_device("meta")` with
device "cpu", so any tensor created without naming its device lands on meta and the step fails
when it meets a real one. The torch path (no C++ kernels, no prepacked matmuls) is the code CUDA
runs; the bf16 comparison with transformers runs here on that path too, with the same checker and
tolerance the `gpu` test uses.
"""

import contextlib

import pytest
import torch
import transformers

from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.inference.engine import resolve_dtype
from asyncrl.models.device import resolve_device
from asyncrl.inference.config import EngineSettings
from asyncrl.inference.decoder_args import DecoderArgs
from asyncrl.inference.model_runner import iter_safetensors
from asyncrl.launch.train import check_engine_placement

VOCAB = 128
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch sees none)")

# |engine - transformers| per token logprob, both in bf16: different kernels and fusions round
# differently (fused q/k/v and gate/up matmuls, RMSNorm rounding, cache vs full-sequence
# attention). Measured on the CPU torch path for this model: max 0.0083 over 72 greedy tokens
# (0.0082 against transformers in fp32: bf16 rounding, not a bug); a wrong mask, position or
# cache slot is off by tenths to units. CUDA kernels round in other places: 6x headroom.
BF16_TOL = 0.05

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**kw):
    kw = {"tie_word_embeddings": True, **kw}
    return transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=768, max_position_embeddings=1024, **kw,
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
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in [3, 8, 17, 30, 5, 12]]


def perturbed_state_dict(model, scale=0.02):
    g = torch.Generator().manual_seed(5)
    return {k: v.cpu() + scale * torch.randn(v.shape, generator=g)
            for k, v in model.state_dict().items()}


def greedy(n):
    return GenerationConfig(max_new_tokens=n, greedy=True)


@contextlib.contextmanager
def meta_default_device():
    """Tensors created on this thread without a device land on meta (no data): mixing one with a
    real tensor raises, and reading one (.tolist()) raises."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


# ---- settings and resolution ---------------------------------------------------------------


def test_settings_validate_device_dtype_and_memory_fraction():
    for ok in ("auto", "cpu", "cuda", "cuda:1"):
        assert EngineSettings(device=ok).device == ok  # syntax only: GPUs may be elsewhere
    for bad in ("gpu", "cuda:x", "cuda:", "CPU", "mps"):
        with pytest.raises(ValueError, match=rf"device='{bad}'.*allowed 'auto', 'cpu', 'cuda'"):
            EngineSettings(device=bad)
    assert EngineSettings().dtype == "auto" and EngineSettings().device == "auto"
    with pytest.raises(ValueError, match="dtype"):
        EngineSettings(dtype="float16")
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_fraction"):
            EngineSettings(gpu_memory_fraction=bad)


def test_resolve_device_and_dtype(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_device("cpu") == cpu
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda", 0)) == torch.float32
    with pytest.raises(ValueError, match="device='tpu'"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == cpu
    with pytest.raises(ValueError, match=r"device='cuda:0' needs CUDA.*allowed here: 'auto'"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device='cuda:2' is out of range; allowed cuda:0 \.\."):
        resolve_device("cuda:2")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_cuda_setting_without_cuda_fails_at_construction(model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda' needs CUDA"):
        LLMEngine(EngineConfig(model_path=str(model_dir), device="cuda", max_seq_len=64))


def test_cpu_defaults_unchanged(model_dir, monkeypatch):
    """auto on a machine without CUDA: fp32 on the CPU, with the C++ / prepacked fast paths."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    eng = LLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=64))
    model = eng.runner.model
    assert eng.device == torch.device("cpu") and eng.sampler.generator.device.type == "cpu"
    assert eng.runner.cache.dtype == model.embed.dtype == torch.float32
    assert model.use_fast and eng.scheduler.num_slots == EngineSettings().max_num_seqs


def test_check_engine_placement_refuses_a_silent_split():
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"device='cpu'.*trainer runs on cuda:0.*'auto' or "
                                         r"'cuda'.*inference.mode='local'.*'remote'"):
        check_engine_placement(cuda, "inprocess", EngineSettings(device="cpu"))
    check_engine_placement(cuda, "local", EngineSettings(device="cpu"))  # servers: their own
    check_engine_placement(torch.device("cpu"), "inprocess", EngineSettings(device="cpu"))


def test_trainer_ranks_pick_their_backend_and_refuse_a_rank_without_a_gpu(monkeypatch):
    """torchrun ranks: gloo for a CPU trainer (train.device=cpu, also where CUDA is), NCCL with one
    GPU per local rank otherwise; a rank beyond the node's GPUs is one clear error, never CUDA's
    "invalid device ordinal" (seen on an H200 with --nproc-per-node 2). CUDA is faked here: the
    check runs before any CUDA call."""
    from asyncrl.errors import UserError
    from asyncrl.train import fsdp

    joined = []
    monkeypatch.setattr(fsdp.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(fsdp.dist, "init_process_group", joined.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert fsdp.init_distributed("cpu") == "cpu" and joined == ["gloo"]
    with pytest.raises(UserError, match=r"rank 1 of this node has no GPU of its own \(1 visible\)"
                                        r".*--nproc-per-node 1.*train.device=cpu"):
        fsdp.init_distributed("cuda:0")
    assert joined == ["gloo"]


# ---- KV cache budget -----------------------------------------------------------------------


def test_num_parameters_matches_transformers():
    for tied in (True, False):
        model = transformers.Qwen2ForCausalLM(tiny_config(tie_word_embeddings=tied))
        cfg = {**model.config.to_dict(), "architectures": ["Qwen2ForCausalLM"]}
        args = DecoderArgs.from_hf_config(cfg)
        assert args.num_parameters() == model.num_parameters()


def test_cuda_kv_budget_caps_slots(model_dir, monkeypatch):
    """The CUDA branch of the slot count, driven with a stubbed free-memory reading: slots =
    min(max_num_seqs, (fraction * free - weights) // bytes per slot), or a clear error."""
    eng = LLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=128, device="cpu",
                                 max_num_seqs=64, gpu_memory_fraction=0.5))
    hf_config = transformers.AutoConfig.from_pretrained(model_dir).to_dict()
    args = DecoderArgs.from_hf_config(hf_config)
    # 4 layers * 2 (k, v) * 2 kv heads * 128 positions * 64 dims * 2 bytes = 256 KiB per slot
    per_slot, weights = 4 * 2 * 2 * 128 * 64 * 2, args.num_parameters() * 2
    eng.device = torch.device("cuda", 0)  # only _num_slots reads it from here on
    free = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 1 << 40))
    free["bytes"] = 2 * (weights + 10 * per_slot + 7)
    assert eng._num_slots(hf_config, torch.bfloat16) == 10
    free["bytes"] = 1 << 40
    assert eng._num_slots(hf_config, torch.bfloat16) == 64  # max_num_seqs caps it
    free["bytes"] = 2 * (weights + per_slot - 1)
    with pytest.raises(ValueError, match=r"no KV cache slot fits on cuda:0.*gpu_memory_fraction="
                                         r"0.5.*max_seq_len=128 needs 262144 bytes.*lower "
                                         r"max_seq_len"):
        eng._num_slots(hf_config, torch.bfloat16)
    eng.config.kv_cache_bytes = 3 * per_slot  # an explicit budget wins over the GPU's memory
    assert eng._num_slots(hf_config, torch.bfloat16) == 3


# ---- no implicit device --------------------------------------------------------------------


def exercise(eng, prompts, weights, disk_dir):
    """Prefill, decode (greedy; sampled with top-k / top-p / a stop-token floor; seeded), a
    weight update mid-stream, one from disk, and a compaction of the slots."""
    gcs = [
        greedy(8),
        GenerationConfig(max_new_tokens=8, temperature=0.7, top_k=5, top_p=0.9),
        GenerationConfig(max_new_tokens=8, min_new_tokens=3, stop_token_ids=[1, 2], seed=4),
        greedy(3),  # finishes first: a survivor moves into its slot
    ]
    reqs = [ModelRequest(p, g) for p, g in zip(prompts, gcs)]
    for r in reqs:
        eng.add_request(r)
    done = {}
    for _ in range(3):
        done.update((o.rid, o) for o in eng.step())
    eng.update_weights_from_state_dict(weights, version=1)
    while eng.has_unfinished():
        done.update((o.rid, o) for o in eng.step())
    eng.update_weights_from_state_dict(iter_safetensors(disk_dir), version=2)
    again = eng.generate([ModelRequest(prompts[4], greedy(4))])
    return [done[r.rid] for r in reqs] + again


@pytest.mark.parametrize(("fast", "cpu_kernels", "backend"), [
    (True, True, "native"),  # the CPU fast paths
    (False, False, "native"),  # the torch path: what CUDA runs
    (False, False, "hf"),  # the transformers fallback (built outside meta: see below)
])
def test_no_tensor_on_an_implicit_device(model_dir, hf, prompts, fast, cpu_kernels, backend):
    weights = perturbed_state_dict(hf)

    def build():
        return LLMEngine(EngineConfig(
            model_path=str(model_dir), max_seq_len=64, device="cpu", fast_matmuls=fast,
            cpu_kernels=cpu_kernels, backend=backend, max_num_seqs=4,
        ))

    ref = exercise(build(), prompts, weights, model_dir)
    if backend == "hf":  # from_pretrained itself refuses a meta default device
        eng = build()
        with meta_default_device():
            got = exercise(eng, prompts, weights, model_dir)
    else:  # construction too: weights, cache, RoPE tables, packed matmuls
        with meta_default_device():
            got = exercise(build(), prompts, weights, model_dir)
    assert [o.output_tokens for o in got] == [o.output_tokens for o in ref]
    assert [o.output_logprobs for o in got] == [o.output_logprobs for o in ref]
    assert got[0].output_versions == [0] * 3 + [1] * 5
    assert got[-1].output_versions == [2] * 4


# ---- against transformers in bf16 (CPU torch path here, CUDA under the gpu marker) ----------


def check_against_hf_bf16(eng, hf_model, prompts, n=12):
    """Greedy outputs of `eng` against `hf_model` (same device, bf16) teacher-forced on them:
    each logprob within BF16_TOL, each token HF's argmax or within BF16_TOL of it (a bf16
    near-tie). Where HF's top-2 margin exceeds 2 * BF16_TOL this is exact greedy agreement, and
    most steps must have such a margin, or the check would prove little."""
    outs = eng.generate([ModelRequest(p, greedy(n)) for p in prompts])
    dev = next(hf_model.parameters()).device
    clear = total = 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o.output_tokens], device=dev)
        with torch.inference_mode():
            lp = torch.log_softmax(hf_model(ids).logits[0, len(p) - 1: -1].float(), -1)
        ref = lp.gather(1, torch.tensor(o.output_tokens, device=dev)[:, None])[:, 0].cpu()
        top2 = lp.topk(2, -1).values.cpu()
        got = torch.tensor(o.output_logprobs)
        err = (got - ref).abs().max().item()
        assert err <= BF16_TOL, (err, got, ref)
        assert ((top2[:, 0] - ref) <= BF16_TOL).all(), (o.output_tokens, top2, ref)
        clear += int((top2[:, 0] - top2[:, 1] > 2 * BF16_TOL).sum())
        total += n
    assert clear >= total // 2, f"only {clear} of {total} greedy steps have a clear margin"
    return outs


def test_bf16_torch_path_matches_transformers_on_cpu(model_dir, prompts):
    """The `gpu` test's checker on the CPU torch path (the code CUDA runs), so its logic and
    tolerance are exercised on every run, not only where a GPU is lent."""
    hf_bf16 = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    eng = LLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=64, device="cpu",
                                 dtype="bfloat16", cpu_kernels=False, fast_matmuls=False))
    check_against_hf_bf16(eng, hf_bf16.eval(), prompts)


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_matches_transformers_bf16(model_dir, prompts):
    """device/dtype auto on a GPU: everything on CUDA in bf16; greedy tokens and logprobs
    against transformers' bf16 forward on the same GPU, before and after a weight update from
    host tensors; sampled logprobs; seeded sampling independent of the batch."""
    eng = LLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=64))
    model = eng.runner.model
    assert eng.device.type == "cuda" and eng.sampler.generator.device.type == "cuda"
    for t in (eng.runner.cache, model.embed, model.rope[""][0], model.layers[0].qkv_w):
        assert t.device == eng.device and t.dtype == torch.bfloat16
    assert model._kernels is None and model._fast is None and model.rope32 is None
    hf_gpu = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    hf_gpu = hf_gpu.to(eng.device).eval()
    check_against_hf_bf16(eng, hf_gpu, prompts)

    weights = perturbed_state_dict(hf_gpu)  # host tensors, fp32: copied to the GPU in bf16
    eng.update_weights_from_state_dict(weights, version=1)
    hf_gpu.load_state_dict(weights)
    outs = check_against_hf_bf16(eng, hf_gpu, prompts)
    assert all(o.output_versions == [1] * 12 for o in outs)

    gc = GenerationConfig(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9)
    for p, o in zip(prompts, eng.generate([ModelRequest(p, gc) for p in prompts])):
        ids = torch.tensor([p + o.output_tokens], device=eng.device)
        with torch.inference_mode():
            logits = hf_gpu(ids).logits[0, len(p) - 1: -1].float() / 0.8
        ref = torch.log_softmax(logits, -1).gather(
            1, torch.tensor(o.output_tokens, device=eng.device)[:, None])[:, 0].cpu()
        assert (torch.tensor(o.output_logprobs) - ref).abs().max() <= BF16_TOL
    seeded = GenerationConfig(max_new_tokens=8, temperature=1.0, seed=42)
    alone = eng.generate([ModelRequest(prompts[0], seeded)])[0]
    crowd = eng.generate([ModelRequest(p, GenerationConfig(max_new_tokens=8))
                          for p in prompts[1:4]] + [ModelRequest(prompts[0], seeded)])[-1]
    assert alone.output_tokens == crowd.output_tokens


@pytest.mark.gpu
@needs_cuda
def test_cuda_kv_budget_hf_fallback_and_errors(model_dir, prompts):
    cfg = EngineConfig(model_path=str(model_dir), max_seq_len=64, max_num_seqs=8)
    assert LLMEngine(cfg).scheduler.num_slots == 8  # a tiny model: max_num_seqs binds
    with pytest.raises(ValueError, match="no KV cache slot fits.*lower max_seq_len"):
        LLMEngine(cfg.model_copy(update={"gpu_memory_fraction": 1e-9}))
    fallback = LLMEngine(cfg.model_copy(update={"backend": "hf", "dtype": "float32"}))
    assert next(fallback.runner.model.parameters()).device.type == "cuda"
    native = LLMEngine(cfg.model_copy(update={"dtype": "float32"}))
    reqs = [ModelRequest(p, greedy(6)) for p in prompts[:3]]
    # fp32 on both paths: the same greedy tokens (TF32 matmuls are off by default in torch)
    assert ([o.output_tokens for o in fallback.generate(reqs)]
            == [o.output_tokens for o in native.generate(reqs)])


def check_architecture_bf16(name, tmp_path, prompts, device):
    """A tiny instance of tests/test_engine_archs.py's architecture `name` on the torch path
    in bf16 on `device`, against transformers' bf16 forward there, before and after a weight
    update."""
    from arch_configs import CONFIGS

    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]).eval()
    with torch.no_grad():  # peaked logits (the head is tied): most greedy steps have a clear
        hf_model.get_input_embeddings().weight.mul_(8.0)  # winner, as a trained model's do
    hf_model.save_pretrained(tmp_path)
    hf_model = hf_model.to(device=device, dtype=torch.bfloat16)
    eng = LLMEngine(EngineConfig(model_path=str(tmp_path), max_seq_len=64, backend="native",
                                 device=device, dtype="bfloat16", cpu_kernels=False,
                                 fast_matmuls=False))
    assert eng.device.type == device
    check_against_hf_bf16(eng, hf_model, prompts)
    weights = perturbed_state_dict(hf_model)
    eng.update_weights_from_state_dict(weights, version=1)
    hf_model.load_state_dict(weights)
    check_against_hf_bf16(eng, hf_model, prompts)


ARCHS = ["qwen3", "llama3", "gemma3", "mistral"]


@pytest.mark.parametrize("name", ARCHS)
def test_each_architecture_on_the_bf16_torch_path_on_cpu(name, tmp_path, prompts):
    """The CUDA test's code path and tolerance, on the CPU, on every run."""
    check_architecture_bf16(name, tmp_path, prompts, "cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ARCHS)
def test_cuda_engine_serves_each_architecture_in_bf16(name, tmp_path, prompts):
    check_architecture_bf16(name, tmp_path, prompts, "cuda")
