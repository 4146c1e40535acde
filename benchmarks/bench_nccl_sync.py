"""Seconds to push real-size weights through the collective weight sync (NCCL on GPUs, gloo on CPU).

Two processes on one machine: rank 0 holds the weights of a preset (Qwen2.5-0.5B and 1.5B
shapes, tied lm_head sent once, --dtype) and is the `DistributedWeightSender`; rank 1 is a
`DistributedWeightReceiver` that stages every tensor (what `asyncrl serve` does before applying
them to its engine; the apply is not timed here). One push = `broadcast(state, version)` on rank 0
until rank 1 has received (and checked) every tensor; rank 1 signals through the group's store.
Ranks start each push together (rank 1 waits in `receive` before rank 0 starts its clock).

Baselines, through the same process group in the same run: "flat" = one broadcast of a single
contiguous buffer of the same bytes, allocated once on each side (the wire's bound: no packing,
no allocation), and "per_tensor" = one broadcast per tensor from the weights themselves into
freshly allocated tensors (the SGLang layout). "s / flat" is each layout's time over the bound.

nccl needs each rank on its own GPU: with one visible GPU, --backend auto uses gloo (tensors go
through host memory), and says so in the header.

    python benchmarks/bench_nccl_sync.py                              # cuda: 0.5B and 1.5B
    python benchmarks/bench_nccl_sync.py --device cpu --preset tiny   # CPU smoke run (gloo)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time

import torch
from gpu_common import check_device, device_name, finish, print_table

from asyncrl.api.weights import WeightUpdateKind, WeightUpdateMeta

from asyncrl.inference.weight_group import DistributedWeightReceiver, DistributedWeightSender

LAYOUTS = ("buckets", "flat", "per_tensor")


def preset_shapes(preset: str) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the preset's state dict, built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.models.presets import TINY, preset_hf_config

    if preset == TINY:
        from asyncrl.models.tiny import tiny_hf_config
        from asyncrl.models.config import TinyModelConfig
        from asyncrl.models.tokenizer import build_byte_tokenizer

        hf_config = tiny_hf_config(TinyModelConfig(), len(build_byte_tokenizer()))
    else:
        hf_config = preset_hf_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if hf_config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # one tensor under two names; sent once
    return shapes


def fill_value(i: int) -> float:
    return (i % 251 + 1) / 256  # exact in bf16: the receiver checks it


def _device(backend: str, rank: int) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _meta(args: dict, port: int) -> WeightUpdateMeta:
    return WeightUpdateMeta(kind=WeightUpdateKind.DISTRIBUTED, version=0, master_port=port,
                            world_size=2, backend=args["backend"],
                            bucket_bytes=args["bucket_mb"] << 20, group_name="bench_sync")


def sender_main(args: dict, port: int, queue) -> None:
    dev = _device(args["backend"], 0)
    dtype = getattr(torch, args["dtype"])
    shapes = preset_shapes(args["preset"])
    state = {n: torch.empty(s, dtype=dtype, device=dev).fill_(fill_value(i))
             for i, (n, s) in enumerate(sorted(shapes.items()))}
    sender = DistributedWeightSender(_meta(args, port), state, timeout_s=600)
    store, g = sender.group.store, sender.group
    times: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    total = sum(t.numel() for t in state.values())
    flat = torch.zeros(total, dtype=dtype, device=dev)  # allocated (and touched) once: the bound
    for rep in range(args["repeats"] + 1):
        for layout in LAYOUTS:
            store.get(f"ready/{rep}/{layout}")
            start = time.perf_counter()
            if layout == "flat":
                g.broadcast(flat)
            else:
                sender.broadcast(state, version=rep + 1, layout=layout)
            store.get(f"done/{rep}/{layout}")
            if rep:  # rep 0 warms up the communicator
                times[layout].append(time.perf_counter() - start)
    sender.close()
    queue.put({"bytes": total * dtype.itemsize, "tensors": len(state),
               "buckets": len(sender.buckets), "seconds": times})


def receiver_main(args: dict, port: int, queue) -> None:
    dev = _device(args["backend"], 1)
    receiver = DistributedWeightReceiver(_meta(args, port), rank=1, timeout_s=600)
    store, g = receiver.group.store, receiver.group
    spec = receiver.spec
    flat = torch.zeros(sum(s.numel for s in spec), dtype=spec[0].dtype, device=dev)
    for rep in range(args["repeats"] + 1):
        for layout in LAYOUTS:
            store.set(f"ready/{rep}/{layout}", b"1")
            if layout == "buckets":
                version, out = receiver.receive()
                bad = [s.name for i, s in enumerate(spec)
                       if float(out[s.name].reshape(-1)[-1]) != fill_value(i)]
                if version != rep + 1 or bad:
                    raise RuntimeError(f"received version {version}, wrong values in {bad[:3]}")
                del out
            elif layout == "flat":
                g.broadcast(flat)
            else:
                for s in spec:
                    g.broadcast(torch.empty(s.shape, dtype=s.dtype, device=dev))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            store.set(f"done/{rep}/{layout}", b"1")
    receiver.close()
    queue.put({"receiver": "ok"})


def run_preset(args: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=f, args=(args, port, queue))
             for f in (sender_main, receiver_main)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + args["timeout_s"]
    while len(results) < 2:
        if any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError(f"no result within {args['timeout_s']} s")
        try:
            results.append(queue.get(timeout=1))
        except Exception:  # queue.Empty: poll the ranks again
            continue
    for p in procs:
        p.join(timeout=30)
    return next(r for r in results if "seconds" in r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda: weights on GPUs (nccl); cpu: host memory (gloo)")
    ap.add_argument("--preset", default="qwen2.5-0.5b,qwen2.5-1.5b", help="comma-separated")
    ap.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                    help="auto: nccl with a GPU per rank, else gloo")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--bucket-mb", type=int, default=64, help="WeightUpdateMeta.bucket_bytes")
    ap.add_argument("--repeats", type=int, default=3, help="best of N (after one warm-up)")
    ap.add_argument("--timeout-s", type=int, default=900)
    ap.add_argument("--record", default=None, metavar="FILE.json", help="write the summary here")
    ns = ap.parse_args()
    device = check_device(ns.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    backend = ns.backend if ns.backend != "auto" else ("nccl" if gpus >= 2 else "gloo")
    note = ("" if ns.backend != "auto" or device.type == "cpu" or gpus >= 2 else
            " (one GPU visible: nccl needs a GPU per rank, so gloo through host memory)")
    print(f"{device_name(device)} | backend {backend}{note} | {ns.dtype} | buckets of "
          f"{ns.bucket_mb} MiB | best of {ns.repeats} | load {os.getloadavg()[0]:.2f}")
    rows, records = [], []
    for preset in ns.preset.split(","):
        args = {"preset": preset, "backend": backend, "dtype": ns.dtype,
                "bucket_mb": ns.bucket_mb, "repeats": ns.repeats, "timeout_s": ns.timeout_s}
        res = run_preset(args)
        best = {k: min(v) for k, v in res["seconds"].items()}
        gb = res["bytes"] / 1e9
        for layout in LAYOUTS:
            ratio = best[layout] / best["flat"]
            name = "ours (buckets)" if layout == "buckets" else layout
            rows.append([preset, f"{gb:.2f}", name, best[layout], gb / best[layout], ratio])
        records.append({"preset": preset, "bytes": res["bytes"], "tensors": res["tensors"],
                        "buckets": res["buckets"], "best_seconds": best,
                        "ours_over_flat": best["buckets"] / best["flat"],
                        "ours_over_per_tensor": best["buckets"] / best["per_tensor"]})
    print_table(["preset", "GB", "layout", "seconds", "GB/s", "s / flat"], rows)
    finish({"bench": "nccl_sync", "device": device_name(device), "backend": backend,
            "dtype": ns.dtype, "bucket_mb": ns.bucket_mb, "rows": records}, ns.record)


if __name__ == "__main__":
    main()
