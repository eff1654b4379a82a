"""Process groups from the torchrun environment, expert placement and small collectives.

``init_distributed()`` reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``) and returns a :class:`DistContext`. Without
them it returns a single-process context (no process group), and every helper here treats
``group=None`` with no initialised process group as that single process.

Backends: on CUDA, one default group with NCCL for CUDA tensors and gloo for CPU tensors
(``"cpu:gloo,cuda:nccl"``) plus a separate gloo group for host-side exchanges; on CPU, gloo alone.
When more ranks run on a host than it has GPUs (correctness tests that share one GPU) NCCL would
refuse, so gloo is used for everything and PyTorch symmetric memory is told that devices overlap.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) can take shared GPUs out of service; every process we start, and every
# library we initialise, must see these before it creates a communicator.
kMulticastSafetyEnv = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def apply_multicast_safety_env(env: dict | None = None) -> dict:
    """Set the variables that keep NVLink multicast off in ``env`` (default ``os.environ``).

    Returns ``env``; pass a copy of ``os.environ`` to build a child process's environment.
    """
    target = os.environ if env is None else env
    target.update(kMulticastSafetyEnv)
    return target


@dataclass(frozen=True)
class ExpertPlacement:
    """Contiguous expert sharding: rank ``r`` owns experts ``[r * E_local, (r + 1) * E_local)``."""

    num_experts: int
    ep_size: int
    ep_rank: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    @property
    def local_experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def owner(self, expert: int) -> int:
        """The EP rank that holds global expert ``expert``."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert must be in [0, {self.num_experts}), got {expert}")
        return expert // self.num_local_experts


def expert_placement(num_experts: int, ep_size: int, ep_rank: int) -> ExpertPlacement:
    """Validate and build the placement of ``num_experts`` over ``ep_size`` ranks."""
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(ep_size, int) or ep_size <= 0:
        raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
    if num_experts % ep_size != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size "
                         f"ep_size={ep_size}: every rank must hold the same number of experts")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank must be in [0, {ep_size}), got {ep_rank}")
    return ExpertPlacement(num_experts, ep_size, ep_rank)


@dataclass
class DistContext:
    """What :func:`init_distributed` set up.

    ``group`` is the default (world) group: NCCL for CUDA tensors and gloo for CPU tensors on GPU
    machines, gloo alone otherwise; ``None`` in a single process. ``cpu_group`` is a gloo group
    over the same ranks for host-side exchanges. ``ep_group`` is the expert-parallel group (the
    world by default). ``owns_process_group`` says whether :meth:`destroy` tears it down.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None
    group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    ep_group: dist.ProcessGroup | None
    owns_process_group: bool

    @property
    def is_distributed(self) -> bool:
        return self.group is not None

    @property
    def ep_size(self) -> int:
        return group_size(self.ep_group)

    @property
    def ep_rank(self) -> int:
        return group_rank(self.ep_group)

    def placement(self, num_experts: int) -> ExpertPlacement:
        return expert_placement(num_experts, self.ep_size, self.ep_rank)

    def destroy(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            # A rank that tears gloo down while a peer still talks to it can abort the peer
            # ("terminate called without an active exception"): leave together.
            dist.barrier(group=self.cpu_group)
            dist.destroy_process_group()
        self.group = self.cpu_group = self.ep_group = None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an int") from None


def _pick_device(local_rank: int, local_world_size: int, device) -> tuple[torch.device, bool]:
    """The rank's device, and whether several ranks share one GPU."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.device_count() == 0:
            raise RuntimeError(f"init_distributed: device={device} was asked for, but no CUDA device is visible")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
    elif torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    shared = device.type == "cuda" and local_world_size > torch.cuda.device_count()
    return device, shared


def init_distributed(backend: str | None = None, device=None,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> DistContext:
    """Initialise torch.distributed from the torchrun environment.

    ``backend``: ``None`` picks ``"cpu:gloo,cuda:nccl"`` on distinct GPUs and ``"gloo"`` on CPU or
    when ranks share a GPU; any string torch accepts is passed through. ``device``: default
    ``cuda:LOCAL_RANK % device_count`` when CUDA is available, else CPU. ``timeout`` bounds every
    collective, so a dead rank becomes an error rather than a hang. Reuses a process group that
    is already initialised (and then does not own it).
    """
    apply_multicast_safety_env()
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= local_rank < max(local_world_size, 1) or local_world_size > max(world_size, 1):
        # A wrapped LOCAL_RANK would put two ranks on one GPU unannounced.
        raise RuntimeError(f"init_distributed: need 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE, got "
                           f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world_size}, WORLD_SIZE={world_size}")
    device, shared_gpu = _pick_device(local_rank, local_world_size, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if shared_gpu:
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"

    owns = False
    if not dist.is_initialized():
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            return DistContext(0, 1, 0, 1, device, None, None, None, None, False)
        if backend is None:
            backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" and not shared_gpu else "gloo"
        kwargs = {"device_id": device} if "nccl" in backend else {}
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
        owns = True
    backend = dist.get_backend()
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, local_world_size, device,
                       backend, world, cpu_group, world, owns)


def as_device(value, name: str) -> torch.device:
    """``torch.device(value)``, or a ValueError naming ``name``: also for a CUDA device this machine
    does not have (torch would raise an AssertionError, or an error deep in the first allocation)."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0', "
                         f"got {value!r} ({error})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise ValueError(f"{name} is {device} but this machine has {count} CUDA device(s)")
    return device


def _check_group(group: object) -> None:
    if group is not None and not isinstance(group, getattr(dist, "ProcessGroup", ())):
        raise TypeError(f"the process group must be None or a torch.distributed.ProcessGroup, got "
                        f"{type(group).__name__}")


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group``; 1 for ``None`` without an initialised process group."""
    _check_group(group)
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 for ``None`` without an initialised process group."""
    _check_group(group)
    if group is None and not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where a collective of ``group`` can move tensors that live on ``device``: the host for gloo
    (which handles few collectives on CUDA tensors), the current GPU for NCCL alone, else ``device``."""
    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def uneven_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None):
    """All-gather tensors whose first dimension differs between ranks.

    ``tensor``: [n_r, ...] on rank r, same trailing shape and dtype everywhere (n_r may be 0).
    Returns ``(gathered [sum n_r, ...] in rank order, counts list[int])`` on the input's device.
    Bytes are moved as uint8, so any dtype (FP8 included) travels through gloo; CUDA tensors go
    through the host when ``group`` is gloo-only (and CPU tensors through the GPU for NCCL alone).
    """
    world = group_size(group)
    if world == 1:
        return tensor, [tensor.shape[0]]
    device = tensor.device
    comm_device = _comm_device(group, device)
    sizes = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=comm_device)
    all_sizes = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    counts = [int(s.item()) for s in all_sizes]
    max_count = max(counts)
    trailing = tensor.shape[1:]
    row_bytes = math.prod(trailing) * tensor.element_size()
    if max_count == 0 or row_bytes == 0:  # nothing to move: zero rows everywhere, or rows of no bytes
        return torch.empty((sum(counts), *trailing), dtype=tensor.dtype, device=device), counts
    send = torch.zeros((max_count, row_bytes), dtype=torch.uint8, device=comm_device)
    if tensor.shape[0]:
        send[: tensor.shape[0]] = tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], row_bytes)
    recv = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(recv, send, group=group)
    rows = torch.cat([r[:c] for r, c in zip(recv, counts)])
    gathered = rows.to(device).view(tensor.dtype).reshape(sum(counts), *trailing)
    return gathered, counts


def reduce_rows_to_owners(partial: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None = None):
    """Sum ``partial`` over ranks and return this rank's rows.

    ``partial``: [sum(counts), ...] float32 on every rank, rows in rank order (as from
    :func:`uneven_all_gather`). Returns the sum over ranks of rows
    ``[offset_r, offset_r + counts[r])`` for this rank ``r``, on the input's device.
    """
    world = group_size(group)
    rank = group_rank(group)
    if world == 1:
        return partial
    if len(counts) != world or sum(counts) != partial.shape[0]:
        raise ValueError(f"counts {counts} do not describe {partial.shape[0]} rows over {world} ranks")
    device = partial.device
    comm = partial.to(_comm_device(group, device), copy=True)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    mine = None
    for r in range(world):
        if counts[r] == 0:
            continue
        chunk = comm[offsets[r]: offsets[r + 1]].contiguous()
        dist.reduce(chunk, dst=dist.get_global_rank(group or dist.group.WORLD, r), group=group)
        if r == rank:
            mine = chunk
    if mine is None:
        mine = comm[offsets[rank]: offsets[rank + 1]]
    return mine.to(device)


def rank_print(*args, group: dist.ProcessGroup | None = None, only_rank: int | None = None,
               file=None, **kwargs) -> None:
    """``print`` prefixed with ``[rank r/n]`` and flushed; ``only_rank`` limits it to one rank."""
    rank, world = group_rank(group), group_size(group)
    if only_rank is not None and rank != only_rank:
        return
    # One write per line: two ranks' prefixes and messages must not interleave. print's sep/end
    # (None: the defaults) and flush (always done) are taken.
    sep, end = kwargs.pop("sep", None), kwargs.pop("end", None)
    sep, end = " " if sep is None else sep, "\n" if end is None else end
    kwargs.pop("flush", None)
    if kwargs:
        raise TypeError(f"rank_print: unexpected arguments {sorted(kwargs)}")
    stream = file if file is not None else sys.stdout
    stream.write(sep.join([f"[rank {rank}/{world}]", *map(str, args)]) + end)
    stream.flush()


def hostname() -> str:
    return socket.gethostname()
