"""Optional C++ kernels (csrc/: attention, RMSNorm, packed fp32 matmuls), compiled on first use.

The sources are built once per machine with the system C++ compiler into asyncrl's cache
(`$ASYNCRL_CACHE/kernels`, else `~/.cache/asyncrl/kernels`) and loaded with ctypes: a plain C ABI
and no torch headers, so a cold build takes about three seconds instead of the minute a torch C++
extension needs. The file name hashes the sources, the compiler, the flags and the CPU's feature
flags (the build uses -march=native, so a cache shared between different machines must not hand
one machine another's binary). The library's OpenMP calls resolve to the libgomp torch already
loaded, so kernels and torch ops share one thread pool.

Anything that goes wrong (no compiler, a failed build, a library that does not load) makes
`load()` return None once, with a warning, and the model keeps its torch path. Set
`ASYNCRL_KERNELS=0` to force the torch path. The C side trusts its pointers: the wrappers here
take care of dtypes, contiguity and output allocation (`new_empty` of an input, so on the CPU
whatever a caller's `torch.set_default_device`: the C side must never get a pointer it cannot read).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

_local = threading.local()


def use_threads(count: int | None) -> None:
    """Threads the kernels called from this thread use (None: torch's process-wide count).

    Per calling thread, unlike `torch.set_num_threads`, which is process-wide: an in-process
    engine thread can use one core while the trainer in the same process keeps the others.
    """
    _local.count = count


def thread_count() -> int:
    return getattr(_local, "count", None) or torch.get_num_threads()

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "attention.cpp", CSRC / "gemm.cpp", CSRC / "layers.cpp"]
HEADERS = [CSRC / "simd.h", CSRC / "ops.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=c++17"]
ATTENTION_HEAD_DIMS = (32, 64, 96, 128, 256)  # the instantiations in the C++ switch
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
ABI = 3  # bump together with asyncrl_kernels_abi() in attention.cpp


def cache_dir() -> Path:
    # The convention of models.loading.cache_root, not imported: it would pull in transformers.
    root = os.environ.get("ASYNCRL_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "asyncrl") / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    key = hashlib.sha256(
        "\0".join([*(f.read_text() for f in SOURCES + HEADERS), version, *FLAGS, _cpu_flags()])
        .encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"asyncrl_kernels_{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses (test workers, several engines)
    # each write their own file, and a reader never sees a half-written library.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", tmp],
            capture_output=True, text=True, timeout=60, check=True,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for suffix in DTYPES.values():
        attn = getattr(lib, f"attention_{suffix}")
        attn.argtypes = [p] * 8 + [i64] * 6 + [f32, i64, i32]
        attn.restype = i32
        norm = getattr(lib, f"rms_norm_{suffix}")
        norm.argtypes = [p] * 3 + [i64, i64, f32, i32]
        norm.restype = None
    lib.gemm_f32.argtypes = [p, i64, p, p, p, i64, p, i64, i64, i64, i64, i32, i32]
    lib.gemm_f32.restype = None
    lib.forward_f32.argtypes = [p, p, p, p, i64, p, i64, p, p, p, p, p, i32]
    lib.forward_f32.restype = i32
    lib.gemm_preferred.argtypes = []
    lib.gemm_preferred.restype = i32
    return lib


class LayerTable(ctypes.Structure):
    """struct LayerWeights in layers.cpp: one layer's norm weights and packed matrices."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("ln1", "qkv", "qkv_bias", "o", "ln2", "gate_up", "down")]


class ModelDims(ctypes.Structure):
    """struct ModelDims in layers.cpp."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in (
            "num_layers", "dim", "qkv_n", "inter", "heads", "kv_heads", "head_dim", "max_len",
            "layer_stride", "kv_stride",
        )),
        ("eps", ctypes.c_float), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
    ]

    def scratch_per_row(self) -> int:
        return self.dim + self.qkv_n + self.heads * self.head_dim + self.inter


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None (after one warning) when it cannot be built or loaded."""
    if os.environ.get("ASYNCRL_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.warning("no C++ compiler found; the decode step uses the slower torch path")
        return None
    try:
        lib = _declare(ctypes.CDLL(str(_build(compiler))))
        if lib.asyncrl_kernels_abi() != ABI:
            raise OSError(f"ABI {lib.asyncrl_kernels_abi()} != {ABI}")
        return lib
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", "") or ""
        logger.warning("C++ kernels unavailable (%s %s); using the torch path", e, detail[-2000:])
        return None


class CpuKernels:
    """Typed wrappers over the library for one model dtype."""

    STORE, ADD_RESIDUAL, SILU_MUL = 0, 1, 2  # gemm epilogues (enum Epilogue in gemm.cpp)

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = DTYPES[dtype]
        self.dtype = dtype
        self._attn = getattr(lib, f"attention_{suffix}")
        self._norm = getattr(lib, f"rms_norm_{suffix}")
        self._gemm = lib.gemm_f32
        self._forward = lib.forward_f32
        # The packed matmuls beat oneDNN where their tile fills the registers (AVX-512 builds).
        self.gemm_preferred = bool(lib.gemm_preferred())

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in DTYPES and head_dim in ATTENTION_HEAD_DIMS

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, dim] contiguous -> a new tensor (x's dtype; w must have the same dtype)."""
        out = torch.empty_like(x)
        rows, dim = x.shape
        self._norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, dim, eps,
                   thread_count())
        return out

    def attention(
        self, qkv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, slots: torch.Tensor | None, positions: torch.Tensor, heads: int,
        scale: float | None = None, window: int = 0,
    ) -> torch.Tensor:
        """RoPE, cache write and causal attention over the cache for one layer.

        qkv [rows, (heads + 2 kv_heads) * hd] with contiguous rows; k, v this layer's contiguous
        [slots, kv_heads, max_len, hd] caches; cos, sin fp32 [max_pos, hd]; slots (None: row i is
        slot i) and positions int64 [rows]: where each row's k, v go, and row r attends to
        positions [0, positions[r]] of its slot (the last `window` of them when window > 0);
        queries are scaled by `scale` (None: hd ** -0.5). Returns [rows, heads * hd].
        """
        rows = qkv.shape[0]
        _, kv_heads, max_len, hd = k.shape
        out = qkv.new_empty(rows, heads * hd)
        err = self._attn(
            qkv.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            None if slots is None else slots.data_ptr(), positions.data_ptr(), out.data_ptr(),
            rows, heads, kv_heads, hd, max_len, qkv.stride(0),
            hd**-0.5 if scale is None else scale, window, thread_count(),
        )
        if err:
            raise ValueError(f"head_dim={hd} is out of range; allowed {ATTENTION_HEAD_DIMS}")
        return out

    def gemm(
        self, a: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None, silu_mul: bool = False,
    ) -> torch.Tensor:
        """fp32 a [m, k] @ W.T for W [n, k] packed by `linear.pack_panels` (or `pack_gate_up`
        with silu_mul: n = 2 * I, returns silu(gate) * up [m, I]); adds the padded bias and the
        [m, n] residual when given."""
        if a.stride(-1) != 1:
            a = a.contiguous()
        m, k = a.shape
        out = a.new_empty(m, n // 2 if silu_mul else n, dtype=torch.float32)
        epilogue = self.STORE
        if silu_mul:
            epilogue = self.SILU_MUL
        elif residual is not None:
            epilogue = self.ADD_RESIDUAL
            if residual.stride(-1) != 1:
                residual = residual.contiguous()
        self._gemm(
            a.data_ptr(), a.stride(0), packed.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.shape[1],
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0), m, n, k, epilogue,
            thread_count(),
        )
        return out

    def forward(
        self, table: ctypes.Array, dims: ModelDims, norm: torch.Tensor, lm_head: torch.Tensor,
        vocab: int, x: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
    ) -> torch.Tensor:
        """fp32 decode forward of embeddings x [rows, dim] (overwritten), row r being cache slot
        r at positions[r]: every layer (`table`, as `dims` describes them and the cache), the
        final norm and lm_head (packed [vocab, dim]) -> logits [rows, vocab]."""
        rows = x.shape[0]
        scratch = x.new_empty(rows * dims.scratch_per_row(), dtype=torch.float32)
        logits = x.new_empty(rows, vocab, dtype=torch.float32)
        err = self._forward(
            table, ctypes.byref(dims), norm.data_ptr(), lm_head.data_ptr(), vocab, x.data_ptr(),
            rows, cache.data_ptr(), None, positions.data_ptr(), scratch.data_ptr(),
            logits.data_ptr(), thread_count(),
        )
        if err:
            raise ValueError(f"head_dim={dims.head_dim} is out of range; allowed "
                             f"{ATTENTION_HEAD_DIMS}")
        return logits
