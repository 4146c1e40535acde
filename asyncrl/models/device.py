"""Where a model runs: the device names a config accepts (checked when it loads, torch-free) and
their resolution on this machine (the engines, the trainer and the launch layer share both)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")
DEVICE_CHOICES = "'auto', 'cpu', 'cuda', 'cuda:N'"


def check_device_spec(value: str | None) -> str | None:
    """Syntax only (None passes: auto): a config written on a CPU head node may name the GPUs of
    its workers."""
    if value is not None and not DEVICE_SPEC.fullmatch(value):
        raise ValueError(f"device={value!r} is not allowed; allowed {DEVICE_CHOICES}")
    return value


def resolve_device(spec: str | None) -> torch.device:
    """"auto" (or None) -> the current CUDA device when torch sees one, else cpu; "cuda" /
    "cuda:N" must exist on this machine (ValueError otherwise). A CUDA result always carries its
    index."""
    import torch

    spec = check_device_spec(spec) or "auto"
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={spec!r} needs CUDA, which this torch ({torch.__version__}) does not see "
            "(no GPU visible, or a CPU-only build); allowed here: 'auto', 'cpu'"
        )
    device = torch.device("cuda" if spec == "auto" else spec)
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device={spec!r} is out of range; allowed cuda:0 .. cuda:{count - 1}")
    return torch.device("cuda", index)
