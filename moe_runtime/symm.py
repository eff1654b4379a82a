"""``SymmBuffer``: one symmetric allocation per rank, sliced into named views.

Every rank of a group allocates the same number of bytes; every rank can address every other
rank's allocation (its *peers*). Kernels only see integers: the base pointer of each rank's
allocation in this process's address space plus the byte offset of a view, the same on every rank.

The layout (:func:`compute_layout`) is pure Python: views are placed in the order given, each at an
offset that is a multiple of :data:`kViewAlignment` bytes.

Backends:

* ``"torch"``: ``torch.distributed._symmetric_memory`` (CUDA IPC handles, peers over NVLink);
* ``"nvshmem"``: nvshmem4py (``nvshmem4py-cu13``), initialised once per process with a unique id
  broadcast over the torch process group;
* ``"host"``: CPU tensors in POSIX shared memory (``/dev/shm``) mapped by every rank of one host;
  the rendezvous and the barrier go through the process group (gloo). It gives CPU runs the same
  semantics as the GPU backends: peer views are live aliases of the peers' memory.
"""

from __future__ import annotations

import math
import os
import tempfile
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_runtime.dist import as_device, group_rank, group_size, hostname

# TMA needs a 16-byte aligned global address; 128 bytes (one L2 cache line, four 32-byte sectors)
# also keeps every view on its own cache lines, so a peer's writes or atomics into one view (the
# signal area above all) never share a line with another view that is being read, and any 16-byte
# vector access or TMA box that starts at a row of a view starts on a line boundary.
kViewAlignment = 128
kBackends = ("host", "torch", "nvshmem")


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class ViewSpec:
    """A named view: ``shape`` elements of ``dtype``, contiguous."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ViewLayout:
    """Where a view lives in the allocation: ``offset`` and ``nbytes`` in bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SymmLayout:
    """The views of one allocation, in placement order, and its total size in bytes."""

    views: tuple[ViewLayout, ...]
    total_bytes: int
    alignment: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.views)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> ViewLayout:
        for v in self.views:
            if v.name == name:
                return v
        raise KeyError(f"no view named {name!r}; this layout has {list(self.names)}")


def compute_layout(specs, alignment: int = kViewAlignment) -> SymmLayout:
    """Place ``specs`` (a sequence of :class:`ViewSpec`) one after another, each offset aligned.

    ``alignment`` must be a power of two >= 16. The total is rounded up to ``alignment`` and is at
    least ``alignment`` bytes, so that an allocation is never empty.
    """
    if not isinstance(alignment, int) or alignment < 16 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 16, got {alignment!r}")
    views, offset, seen = [], 0, set()
    for spec in specs:
        if not isinstance(spec, ViewSpec):
            raise TypeError(f"specs must hold ViewSpec, got {type(spec).__name__}")
        if spec.name in seen:
            raise ValueError(f"view name {spec.name!r} appears twice")
        seen.add(spec.name)
        shape = tuple(spec.shape)
        if any((not isinstance(d, int)) or d < 0 for d in shape):
            raise ValueError(f"view {spec.name!r}: shape must be non-negative ints, got {shape}")
        itemsize = torch.empty((), dtype=spec.dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        offset = align_up(offset, alignment)
        views.append(ViewLayout(spec.name, shape, spec.dtype, offset, nbytes))
        offset += nbytes
    return SymmLayout(tuple(views), max(align_up(offset, alignment), alignment), alignment)


class _HostBackend:
    """CPU memory shared by the ranks of one host through files in ``/dev/shm``."""

    name = "host"

    def __init__(self, nbytes: int, group, device: torch.device):
        if device.type != "cpu":
            raise ValueError(f"the host SymmBuffer backend allocates CPU memory, got device={device}")
        self.rank, self.world_size = group_rank(group), group_size(group)
        self.group = group
        if self.world_size > 1:
            hosts = [None] * self.world_size
            dist.all_gather_object(hosts, hostname(), group=group)
            if len(set(hosts)) != 1:
                raise NotImplementedError(f"the host SymmBuffer backend needs every rank on one host "
                                          f"(shared memory); the group spans {sorted(set(hosts))}")
        tag = [f"moe_symm_{os.getpid()}_{uuid.uuid4().hex[:16]}"]
        if self.world_size > 1:
            dist.broadcast_object_list(tag, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        paths = [os.path.join(folder, f"{tag[0]}_r{r}") for r in range(self.world_size)]
        fd = os.open(paths[self.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                # Reserve the pages now: a full tmpfs then fails here with ENOSPC instead of killing
                # the process with SIGBUS on first touch.
                os.posix_fallocate(fd, 0, nbytes)
                error = ""
            except OSError as err:
                error = f"rank {self.rank} cannot reserve {nbytes} bytes in {folder}: {err}"
            finally:
                os.close(fd)
            # Every rank learns whether every file exists before any maps one: all raise together.
            errors = [error] * self.world_size
            if self.world_size > 1:
                dist.all_gather_object(errors, error, group=group)
            if any(errors):
                raise RuntimeError("host SymmBuffer: " + "; ".join(e for e in errors if e))
            self.buffers = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in paths]
            self.barrier()  # every rank has mapped every file; the mappings outlive the names
        finally:
            # Also on any failure: a named file left in /dev/shm would outlive every process.
            os.unlink(paths[self.rank])

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def destroy(self) -> None:
        self.buffers = []


class _TorchBackend:
    """PyTorch symmetric memory (``torch.distributed._symmetric_memory``, torch >= 2.6)."""

    name = "torch"

    def __init__(self, nbytes: int, group, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"the torch SymmBuffer backend needs a CUDA device, got device={device}")
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as err:
            raise RuntimeError(f"the torch SymmBuffer backend needs torch.distributed._symmetric_memory: {err}") from err
        if not dist.is_initialized():
            raise RuntimeError("the torch SymmBuffer backend needs an initialised process group "
                               "(moe_runtime.init_distributed() under torchrun)")
        group = group or dist.group.WORLD
        self.rank, self.world_size = group_rank(group), group_size(group)
        local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(local, group)
        self.buffers = [local if r == self.rank else self.handle.get_buffer(r, (nbytes,), torch.uint8, 0)
                        for r in range(self.world_size)]

    def barrier(self) -> None:
        # Stream-ordered: work queued after it on the current stream sees the peers' earlier writes.
        self.handle.barrier(channel=0)

    def destroy(self) -> None:
        self.buffers = []
        self.handle = None


_nvshmem_state: dict = {}


def _import_nvshmem():
    try:
        import nvshmem.core as nvshmem_core
        from cuda.core import Device
    except ImportError as err:
        raise RuntimeError("the nvshmem SymmBuffer backend needs nvshmem4py-cu13 and cuda-core >= 1.0 "
                           f"(pip install nvshmem4py-cu13 cuda-core): {err}") from err
    return nvshmem_core, Device


class _NvshmemBackend:
    """nvshmem4py symmetric heap; NVSHMEM is initialised once per process over the world group."""

    name = "nvshmem"

    def __init__(self, nbytes: int, group, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"the nvshmem SymmBuffer backend needs a CUDA device, got device={device}")
        nvshmem_core, Device = _import_nvshmem()
        self.rank, self.world_size = group_rank(group), group_size(group)
        if dist.is_initialized() and self.world_size != dist.get_world_size():
            raise NotImplementedError("the nvshmem SymmBuffer backend spans the world group only "
                                      f"(group size {self.world_size}, world {dist.get_world_size()})")
        self.nvshmem = nvshmem_core
        if not _nvshmem_state.get("initialized"):
            cuda_device = Device(device.index if device.index is not None else torch.cuda.current_device())
            cuda_device.set_current()
            uid = nvshmem_core.get_unique_id(empty=self.rank != 0)
            if self.world_size > 1:
                import numpy

                payload = [bytes(uid._data.view(numpy.uint8)) if self.rank == 0 else None]
                dist.broadcast_object_list(payload, src=0)
                uid._data.view(numpy.uint8)[:] = numpy.frombuffer(payload[0], dtype=numpy.uint8)
            nvshmem_core.init(device=cuda_device, uid=uid, rank=self.rank, nranks=self.world_size,
                              initializer_method="uid")
            _nvshmem_state["initialized"] = True
        local = nvshmem_core.tensor((nbytes,), dtype=torch.uint8)
        self.local = local
        self.buffers = [local if r == self.rank else nvshmem_core.get_peer_tensor(local, r)
                        for r in range(self.world_size)]

    def barrier(self) -> None:
        self.nvshmem.barrier_all(stream=self.nvshmem.NvshmemStream(torch.cuda.current_stream()))

    def destroy(self) -> None:
        self.barrier()
        torch.cuda.current_stream().synchronize()
        self.buffers = []
        self.nvshmem.free_tensor(self.local)
        self.local = None


def default_backend(device: torch.device) -> str:
    """``MOE_SYMM_BACKEND`` when set, else ``"torch"`` on CUDA and ``"host"`` on CPU."""
    name = os.environ.get("MOE_SYMM_BACKEND")
    if name:
        return name
    return "torch" if device.type == "cuda" else "host"


class SymmBuffer:
    """One symmetric allocation of ``layout.total_bytes`` per rank of ``group``, sliced into views.

    ``group``: the process group (``None``: the world, or a single process). ``backend``: one of
    ``"host"``, ``"torch"``, ``"nvshmem"`` or ``None`` (:func:`default_backend`). ``device``: the
    allocation's device (default: the current CUDA device when available, else CPU; the host
    backend is always CPU). ``config``: anything the creator wants to keep with the buffer (for
    example the sizes it was computed from).

    Creating and destroying are collective over ``group``. Views are zero-initialised only by the
    host backend; the GPU backends return uninitialised memory.
    """

    def __init__(self, layout: SymmLayout, group: dist.ProcessGroup | None = None, backend: str | None = None,
                 device=None, config=None):
        if not isinstance(layout, SymmLayout):
            raise TypeError(f"layout must be a SymmLayout (see compute_layout), got {type(layout).__name__}")
        impls = {"host": _HostBackend, "torch": _TorchBackend, "nvshmem": _NvshmemBackend}
        requested = backend if backend is not None else os.environ.get("MOE_SYMM_BACKEND") or None
        if requested is not None and requested not in impls:
            source = "backend" if backend is not None else "MOE_SYMM_BACKEND"
            raise ValueError(f"{source} must be one of {kBackends}, got {requested!r}")
        if device is None:  # the backend first: "host" (argument or environment) allocates CPU memory
            device = torch.device("cuda", torch.cuda.current_device()) if (
                torch.cuda.is_available() and requested != "host") else torch.device("cpu")
        device = as_device(device, "device")
        backend = requested if requested is not None else default_backend(device)
        self.layout = layout
        self.group = group
        self.config = config
        self.device = device
        self._impl = impls[backend](layout.total_bytes, group, device)
        self.backend = backend
        self.rank, self.world_size = self._impl.rank, self._impl.world_size

    @property
    def destroyed(self) -> bool:
        return self._impl is None

    def _buffers(self) -> list[torch.Tensor]:
        if self._impl is None:
            raise RuntimeError("this SymmBuffer was destroyed")
        return self._impl.buffers

    @property
    def buffer(self) -> torch.Tensor:
        """This rank's whole allocation, uint8 [total_bytes]."""
        return self._buffers()[self.rank]

    def _slice(self, base: torch.Tensor, name: str) -> torch.Tensor:
        v = self.layout[name]
        return base[v.offset: v.offset + v.nbytes].view(v.dtype).view(v.shape)

    def view(self, name: str) -> torch.Tensor:
        """This rank's view ``name`` (shape and dtype from the layout)."""
        return self._slice(self.buffer, name)

    __getitem__ = view

    def peer_view(self, name: str, peer: int) -> torch.Tensor:
        """View ``name`` of rank ``peer``'s allocation, addressable from this process."""
        buffers = self._buffers()
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer must be in [0, {self.world_size}), got {peer}")
        return self._slice(buffers[peer], name)

    @property
    def peer_ptrs(self) -> list[int]:
        """Base address of every rank's allocation in this process's address space, by rank."""
        return [b.data_ptr() for b in self._buffers()]

    def view_ptrs(self, name: str) -> list[int]:
        """Address of view ``name`` on every rank (base + the view's offset), by rank."""
        offset = self.layout[name].offset
        return [p + offset for p in self.peer_ptrs]

    def barrier(self) -> None:
        """Collective over the group: writes made before it (to any rank's views) are visible after."""
        if self._impl is None:
            raise RuntimeError("this SymmBuffer was destroyed")
        self._impl.barrier()

    def destroy(self) -> None:
        """Collective: release the allocation on every rank. Safe to call twice."""
        if self._impl is None:
            return
        impl, self._impl = self._impl, None
        impl.destroy()

    def __enter__(self) -> "SymmBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else f"{self.layout.total_bytes} bytes"
        return (f"SymmBuffer(backend={self.backend!r}, rank={self.rank}/{self.world_size}, {state}, "
                f"views={list(self.layout.names)})")
