"""Copies between host memory and KV tensors on an accelerator, off the engine's stream (worker side).

On CUDA a copy between the device and ordinary (pageable) host memory goes through a bounce
buffer of the driver and blocks the calling thread; from page-locked memory it is DMA and
asynchronous. So the host memory kvtier copies from and to is registered page-locked
(``cudaHostRegister`` through torch's cudart): the whole mapping a buffer belongs to, once (the
server's shared arena that a client maps, the embedded store's arena, the saver's staging ring).
Copies run on a stream of their own; the stream first waits (on the device, not on the host) for
the work queued on the engine's stream, so a save reads what the forward pass wrote and a load
never writes a block a queued kernel still uses. The copies' completion is an event: the worker
waits on it where vLLM needs the bytes (before a loaded request runs, before the objects copied
from are released, before the saver thread reads the staging ring), and nothing here ever
synchronises the engine's stream.

On other accelerators the copies are plain blocking torch copies.
"""

from __future__ import annotations

import logging
import mmap
import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines

#: cudaHostRegisterPortable: page-locked for every CUDA context of the process
_PORTABLE = 1


def _owner(buffer):
    """The object that owns a buffer's memory (a memoryview's exporter, an array's base)."""
    obj = buffer
    while True:
        if isinstance(obj, memoryview):
            obj = obj.obj
        elif isinstance(obj, np.ndarray) and obj.base is not None:
            obj = obj.base
        else:
            return obj


@dataclass
class _Locked:
    owner: object
    hold: memoryview  # an export: the owner cannot be unmapped (mmap.close fails) while locked
    address: int
    size: int


def _cudart_register(address: int, size: int) -> bool:
    if int(torch.cuda.cudart().cudaHostRegister(address, size, _PORTABLE)) == 0:
        return True
    _drain_cuda_error()
    return False


def _drain_cuda_error() -> None:
    """A refused registration stays this thread's last CUDA error, which the next kernel launch
    in the process (vLLM's own) would raise: a launch of ours takes it (torch binds no
    ``cudaGetLastError``). Seen on an H200: the second registration of a mapping is refused
    (cudaErrorHostMemoryAlreadyRegistered) and the next indexed copy raised it."""
    try:
        torch.empty(1, device="cuda").zero_()
    except RuntimeError:  # torch.AcceleratorError: the error taken
        pass


def _cudart_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class PageLocks:
    """The host mappings registered page-locked. A mapping is locked whole, at its first copy,
    and stays mapped while locked (a view of it is held). One that nobody else holds any more
    (the client mapped a new arena after a server restart) is unregistered at the next lock, and
    then freed. Memory another owner lends (bytes, a bytearray that could be resized) is never
    locked: copies from it are staged by the driver."""

    #: references to a locked owner that are ours: the record, the held view, getrefcount's argument
    _OURS = 3

    def __init__(self, register: Callable[[int, int], bool] = _cudart_register,
                 unregister: Callable[[int], None] = _cudart_unregister) -> None:
        self._register, self._unregister = register, unregister
        self._locked: dict[int, _Locked] = {}
        self._refused = weakref.WeakValueDictionary()  # owners whose registration failed: not retried
        self._mutex = threading.Lock()  # loads and saves may come from different threads

    def lock(self, buffer) -> bool:
        """Whether ``buffer``'s memory is page-locked (registering its mapping now if need be)."""
        with self._mutex:
            return self._lock_owner(_owner(buffer))

    def _lock_owner(self, owner) -> bool:
        key = id(owner)
        locked = self._locked.get(key)
        if locked is not None and locked.owner is owner:
            return True
        self._drop_abandoned()
        if self._refused.get(key) is owner or not isinstance(owner, (mmap.mmap, np.ndarray)):
            return False
        hold = memoryview(owner)
        if isinstance(owner, np.ndarray):
            if not owner.flags.c_contiguous:
                return False
            address, size = owner.ctypes.data, owner.nbytes
        else:
            array = np.frombuffer(hold, dtype=np.uint8)
            address, size = array.ctypes.data, array.nbytes
            del array
        if not self._register(address, size):
            log.warning("kvtier: cannot page-lock %d bytes of host memory; copies from it are staged", size)
            self._refused[key] = owner
            return False
        self._locked[key] = _Locked(owner, hold, address, size)
        return True

    @property
    def locked_bytes(self) -> int:
        return sum(p.size for p in self._locked.values())

    def _drop_abandoned(self) -> None:
        for key, locked in list(self._locked.items()):
            if sys.getrefcount(locked.owner) <= self._OURS:
                self._release(key)

    def _release(self, key: int) -> None:
        locked = self._locked.pop(key)
        self._unregister(locked.address)
        locked.hold.release()

    def close(self) -> None:
        with self._mutex:
            for key in list(self._locked):
                self._release(key)


#: The process's one record of the mappings it registered: registration is the process's state,
#: and a mapping registered a second time is refused. Every group's pages and their twins (loads,
#: saves) copy to and from the same arena and ring.
PROCESS_PAGE_LOCKS = PageLocks()


class DeviceCopies:
    """The copies of one device's KV: on CUDA on a stream of their own, between page-locked host
    memory and the device, their completion an event."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.page_locks = PROCESS_PAGE_LOCKS if self.cuda else None
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.engine_stream = torch.cuda.current_stream(device)  # built on the engine's thread
        self.done = None  # the event recorded after the last copies queued (None: all done)

    @contextmanager
    def copying(self, host, engine_waits: bool = False) -> Iterator["DeviceCopies"]:
        """Queue copies to or from ``host`` (a buffer) inside the block. With ``engine_waits``
        (copies out of vLLM's blocks, queued from the engine's thread), the engine's later
        kernels wait on the device for them: a block freed after this step is not rewritten
        before it was read."""
        if not self.cuda:
            yield self
            return
        self.page_locks.lock(host)
        self.stream.wait_stream(self.engine_stream)
        with torch.cuda.stream(self.stream):
            yield self
            done = torch.cuda.Event()
            done.record(self.stream)
        if engine_waits:
            self.engine_stream.wait_event(done)
        self.done = done

    def index(self, block_ids) -> torch.Tensor:
        return torch.as_tensor(np.asarray(block_ids, dtype=np.int64)).to(self.device, non_blocking=self.cuda)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the device: one transfer where it is contiguous, one per leading index else."""
        if host.is_contiguous():
            return host.to(self.device, non_blocking=self.cuda)
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        for i in range(host.shape[0]):
            out[i].copy_(host[i], non_blocking=self.cuda)
        return out

    def to_host(self, device: torch.Tensor, host: torch.Tensor) -> None:
        """A contiguous device tensor into a contiguous host tensor of the same bytes."""
        host.copy_(device.view(torch.uint8).view(host.shape), non_blocking=self.cuda)

    def wait(self) -> None:
        """Wait for the copies queued so far (not for the engine's work)."""
        if self.done is not None:
            self.done.synchronize()

