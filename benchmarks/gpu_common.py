"""Shared pieces of the real-size benchmarks (bench_gpu_engine, bench_gpu_train, bench_nccl_sync).

Each of them runs on a GPU (`--device cuda`, the Qwen2.5 presets) and, as a smoke run, on CPU
(`--device cpu --preset tiny`). This module holds the device matmul probe every header prints
(the number that makes results comparable across machines), timing that waits for the device,
the preset model directory, the table printer and the `--record` writer.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

H100_BF16_DENSE_FLOPS = 989e12  # the default MFU denominator (H100 SXM, bf16, dense)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: no CUDA device on this machine (try --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {device}: allowed cpu, cuda, cuda:N")
    return dev


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of `fn()`, including the device work it queued."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding and head count once)."""
    return sum(p.numel() for p in model.parameters())


def matmul_gflops(device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32,
                  n: int | None = None, reps: int = 20) -> float:
    """Best-of-`reps` square matmul GFLOP/s on `device` in `dtype` (a quiet moment suffices)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b), device) for _ in range(reps))
    return 2 * n**3 / best / 1e9


def bandwidth_gbs(device: torch.device, gib: float = 1.0, reps: int = 10) -> float:
    """Device-to-device copy GB/s (read + write) of a `gib` buffer."""
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    seconds = min(timed(lambda: y.copy_(x), device) for _ in range(reps))
    return 2 * x.numel() / seconds / 1e9


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def preset_model_dir(preset: str, dtype: str) -> Path:
    """The cached random-init model of `preset` (built on first use: ~10 s for 0.5B on CPU)."""
    from asyncrl.models.presets import ensure_preset_model

    return ensure_preset_model(preset, dtype)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(" ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print(" ".join(c.rjust(w) for c, w in zip(row, widths)), flush=True)


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def finish(summary: dict, record: str | None) -> None:
    """The one-line JSON summary (last line of stdout), and the record file when asked."""
    summary = {**summary, "command": " ".join(["python", *sys.argv]),
               "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(json.dumps(summary, separators=(",", ":")))
    if record:
        Path(record).parent.mkdir(parents=True, exist_ok=True)
        Path(record).write_text(json.dumps(summary, indent=1) + "\n")
