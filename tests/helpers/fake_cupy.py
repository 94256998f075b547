"""A simulator of the part of CuPy and ``cupy.cuda.nccl`` that aiodist_cuda uses, on host memory,
so the NCCL backend runs for real on the CPU in tests (tests/test_cuda_sim.py).

Memory: "device memory" is numpy memory; a pointer is its real address. Every allocation (device
or pinned host) is registered, and every pointer NCCL or ``memcpyAsync`` is handed is checked
against the registry (a stale or out-of-range pointer is an error, not a segfault).

Streams are asynchronous, as CUDA's: each keeps a FIFO of work run in order by a worker thread
(started while it has work, gone when idle). Events mark a point of a stream; ``wait_event``
makes a stream wait for that point. NCCL calls check their arguments at the call (errors come
back at once, as NCCL's do) and run on the stream: a collective waits there until every rank of
the communicator has made the same k-th call, then writes its own result. ``groupStart`` /
``groupEnd`` (per thread, nestable) batch the calls; a batch is one piece of stream work in which
sends deposit copies into per-(src, dst) FIFOs, then collectives run, then receives take from the
FIFOs. Ranks that disagree on a call (op, count, type, root) fail it with an asynchronous error
(``check_async_error``), and the simulator records it in ``Sim.unexpected``; with
``Sim.hang_on_error`` the failed kernel also never ends (until an abort), as a real one on a lost peer.

``ncclCommInitRank`` (``NcclCommunicator(...)``) blocks until every rank of the unique id joined.
``abort()`` wakes this rank's blocked calls and marks the rank gone, so peers waiting on it fail
too; ``Sim.shutdown()`` (the fixture's teardown) breaks everything still waiting.

``install(monkeypatch)`` puts the fake ``cupy`` / ``cupyx`` modules in ``sys.modules``, makes
aiodist_cuda's probe return them, and swaps aiodist_cuda's PREMUL_SUM maker (it calls libnccl
through ctypes) for one whose op ids this simulator's communicators understand.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import os
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Sim", "install", "NcclError", "CUDARuntimeError", "ndarray"]

# NCCL's ncclDataType_t -> numpy dtype (bfloat16, 9, where ml_dtypes is installed)
_NCCL_NP: dict[int, Any] = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16}
_NCCL_NP.update({7: np.float32, 8: np.float64})
try:
    import ml_dtypes

    _NCCL_NP[9] = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - depends on the environment
    pass


def _floating(dt: np.dtype[Any]) -> bool:
    """A floating type (numpy's, or ml_dtypes' bfloat16, whose numpy kind is "V")."""
    return dt.kind == "f" or dt.name == "bfloat16"


_SUM, _PROD, _MAX, _MIN, _AVG = 0, 1, 2, 3, 4
_NUM_OPS = 5  # ncclNumOps: user-made ops (PreMulSum) get ids from here
_ERR = {0: "NCCL_ERROR_SUCCESS", 1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR", 2: "NCCL_ERROR_SYSTEM_ERROR"}
_ERR.update({3: "NCCL_ERROR_INTERNAL_ERROR", 4: "NCCL_ERROR_INVALID_ARGUMENT", 5: "NCCL_ERROR_INVALID_USAGE"})
_WAIT_S = 20.0  # a simulated kernel gives up after this long (a test hang, reported as an error)


class NcclError(RuntimeError):
    """CuPy's ``cupy.cuda.nccl.NcclError``: ``status`` is the ncclResult_t."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        super().__init__(f"{_ERR.get(status, f'NCCL_ERROR_{status}')}: (simulated) {detail}")


class CUDARuntimeError(RuntimeError):
    """CuPy's ``cupy_backends.cuda.api.runtime.CUDARuntimeError``."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        super().__init__(f"cudaError {status}: (simulated) {detail}")


# -- the simulator's state -------------------------------------------------------------------------


class Sim:
    """One test's simulated machine: devices, allocations, streams, NCCL cliques."""

    def __init__(self, device_count: int = 1) -> None:
        self.device_count = device_count
        self.lock = threading.Lock()
        self._starts: list[int] = []  # sorted allocation addresses
        self._allocs: dict[int, tuple[int, str, int, Any]] = {}  # address -> (nbytes, kind, device, weakref or keeper)
        self.streams: dict[int, Stream] = {}
        self._next_stream = 0x5000
        self.cliques: dict[Any, _Clique] = {}
        self.premul: dict[tuple[int, int], float] = {}  # (comm handle, op id) -> factor
        self._next_handle = 0x7000
        self.unexpected: list[str] = []  # mismatched calls seen by the simulator
        self.calls: collections.Counter[str] = collections.Counter()  # NCCL calls made, by name
        self.null: dict[int, Stream] = {}
        self.local = threading.local()
        self.closed = False
        #: a failed call leaves its kernel waiting until the communicator is aborted (as NCCL's
        #: kernels do on a lost peer) instead of ending with an asynchronous error
        self.hang_on_error = False

    # memory
    def register(self, arr: np.ndarray, kind: str, device: int, keep: Any = None) -> None:
        if arr.nbytes == 0:
            return
        addr = arr.ctypes.data
        with self.lock:
            ref = keep if keep is not None else weakref.ref(arr)
            if addr not in self._allocs:
                bisect.insort(self._starts, addr)
            self._allocs[addr] = (arr.nbytes, kind, device, ref)

    def lookup(self, ptr: int, nbytes: int) -> tuple[str, int] | None:
        """(kind, device) of the live allocation holding ``[ptr, ptr + nbytes)``, else None."""
        with self.lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            while i >= 0:
                addr = self._starts[i]
                size, kind, device, ref = self._allocs[addr]
                alive = ref() is not None if isinstance(ref, weakref.ref) else True
                if not alive:
                    del self._allocs[addr]
                    del self._starts[i]
                    i -= 1
                    continue
                if ptr + nbytes <= addr + size:
                    return kind, device
                return None
            return None

    def check_ptr(self, ptr: int, nbytes: int, kinds: tuple[str, ...], what: str, device: int | None = None) -> None:
        if nbytes == 0:
            return
        got = self.lookup(ptr, nbytes)
        if got is None:
            raise NcclError(4, f"{what}: {nbytes} bytes at {ptr:#x} are not inside a live allocation")
        if got[0] not in kinds:
            raise NcclError(4, f"{what}: {ptr:#x} is {got[0]} memory, expected {' or '.join(kinds)}")
        if device is not None and got[0] == "device" and got[1] != device:
            raise NcclError(4, f"{what}: {ptr:#x} is on cuda:{got[1]}, the communicator on cuda:{device}")

    # streams and devices of the calling thread
    def current_device(self) -> int:
        return int(getattr(self.local, "device", 0))

    def current_stream(self, device: int | None = None) -> Stream:
        d = self.current_device() if device is None else device
        cur: dict[int, Stream] = getattr(self.local, "streams", {})
        s = cur.get(d)
        return s if s is not None else self.null_stream(d)

    def null_stream(self, device: int) -> Stream:
        with self.lock:
            s = self.null.get(device)
        if s is None:
            s = Stream(_null_device=device)
            with self.lock:
                s = self.null.setdefault(device, s)
        return s

    def stream_of(self, ptr: int) -> Stream:
        if ptr == 0:
            return self.current_stream()
        s = self.streams.get(ptr)
        if s is None:
            raise CUDARuntimeError(400, f"no stream {ptr:#x} (cudaErrorInvalidResourceHandle)")
        return s

    def shutdown(self) -> None:
        """Break every clique: whatever still waits in the simulator fails now."""
        self.closed = True
        for c in list(self.cliques.values()):
            c.break_all("the simulator was shut down")


_sim: Sim | None = None


def sim() -> Sim:
    if _sim is None:
        raise RuntimeError("fake_cupy is not installed")
    return _sim


# -- arrays -----------------------------------------------------------------------------------------


class _Flags:
    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)


class _MemPtr:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class Device:
    """``cupy.cuda.Device``: the thread's current device, as a context manager or with ``use()``."""

    def __init__(self, device: int | None = None) -> None:
        self.id = sim().current_device() if device is None else int(device)
        if not 0 <= self.id < sim().device_count:
            raise CUDARuntimeError(101, f"invalid device ordinal {self.id}")
        self._prev: list[int] = []

    def use(self) -> None:
        sim().local.device = self.id

    def __enter__(self) -> Device:
        self._prev.append(sim().current_device())
        self.use()
        return self

    def __exit__(self, *exc: object) -> None:
        sim().local.device = self._prev.pop()

    def synchronize(self) -> None:
        """Wait for everything queued on this device: its streams and its null stream."""
        for s in [*sim().streams.values(), sim().null_stream(self.id)]:
            if s.device_id == self.id:
                s.synchronize()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class ndarray:  # noqa: N801 - CuPy's name
    """``cupy.ndarray`` in simulated device memory (a numpy array ``_h`` the test must not touch)."""

    __module__ = "cupy"  # aiodist.backends.device.device_type() knows CuPy arrays by their module

    def __init__(self, shape: Any, dtype: Any = float, *, _base: np.ndarray | None = None, _device: int | None = None) -> None:
        if _base is None:
            dt = np.dtype(dtype)
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            raw = np.empty(max(n, 1), dtype=np.uint8)  # one byte at least: a real address
            _base = raw[:n].view(dt).reshape(shape)
            self._device = sim().current_device() if _device is None else _device
            sim().register(raw, "device", self._device, keep=None)
            self._raw = raw
        else:
            self._device = int(_device or 0)
            self._raw = None
        self._h = _base

    # attributes aiodist_cuda reads
    @property
    def dtype(self) -> np.dtype[Any]:
        return self._h.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._h.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(self._h.strides)

    @property
    def ndim(self) -> int:
        return int(self._h.ndim)

    @property
    def size(self) -> int:
        return int(self._h.size)

    @property
    def nbytes(self) -> int:
        return int(self._h.nbytes)

    @property
    def itemsize(self) -> int:
        return int(self._h.itemsize)

    @property
    def flags(self) -> _Flags:
        return _Flags(self._h)

    @property
    def data(self) -> _MemPtr:
        return _MemPtr(int(self._h.ctypes.data))

    @property
    def device(self) -> Device:
        return Device(self._device)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False), "strides": self.strides, "version": 3}

    def __len__(self) -> int:
        return len(self._h)

    def __getitem__(self, key: Any) -> ndarray:
        view = ndarray(0, _base=self._h[key], _device=self._device)
        view._raw = self._raw if self._raw is not None else self  # keeps the allocation alive
        return view

    def reshape(self, *shape: Any) -> ndarray:
        view = ndarray(0, _base=self._h.reshape(*shape), _device=self._device)
        view._raw = self._raw if self._raw is not None else self
        return view

    def __repr__(self) -> str:
        return f"fake_cupy.ndarray(shape={self.shape}, dtype={self.dtype}, device={self._device})"

    # host <-> device
    def get(self, stream: Stream | None = None, order: str = "C", out: np.ndarray | None = None, blocking: bool = True) -> np.ndarray:
        """A host copy, made on ``stream`` (the current one by default); ``blocking``: wait for it."""
        s = stream if stream is not None else sim().current_stream(self._device)
        if out is None:
            out = np.empty(self.shape, dtype=self.dtype)
        elif out.shape != self._h.shape or out.dtype != self.dtype:
            raise ValueError(f"Shape/dtype mismatch: out is {out.dtype}{out.shape}, array {self.dtype}{self.shape}")
        if not out.flags.c_contiguous:
            raise RuntimeError("Non-contiguous out is not supported")
        src, dst = self, out
        s.enqueue(lambda: np.copyto(dst, src._h), "get")
        if blocking:
            s.synchronize()
        return out

    def set(self, arr: np.ndarray, stream: Stream | None = None) -> None:
        """Copy host ``arr`` in, on ``stream`` (asynchronous there; the current stream: synchronous)."""
        arr = np.asarray(arr)
        if arr.shape != self._h.shape or arr.dtype != self.dtype:
            raise ValueError(f"Shape/dtype mismatch: {arr.dtype}{arr.shape} into {self.dtype}{self.shape}")
        s = stream if stream is not None else sim().current_stream(self._device)
        dst = self
        s.enqueue(lambda: np.copyto(dst._h, arr), "set")
        if stream is None:
            s.synchronize()

    def copy(self) -> ndarray:
        out = ndarray(self.shape, self.dtype, _device=self._device)
        src = self
        sim().current_stream(self._device).enqueue(lambda: np.copyto(out._h, src._h), "copy")
        return out

    # kernels (what tests/gpu/test_nccl_ops.py calls): each runs on the current stream, as
    # CuPy's do; checks (dtype casting, shapes) raise at the call, as CuPy's do
    def fill(self, value: Any) -> None:
        dst = self
        np.empty(0, dtype=self.dtype).fill(value)  # a value the dtype cannot hold raises here
        sim().current_stream(self._device).enqueue(lambda: dst._h.fill(value), "fill")

    def sum(self, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: bool = False) -> ndarray:
        if out is not None:
            raise NotImplementedError("fake_cupy: sum(out=...)")
        return _kernel(lambda a: np.sum(a, axis=axis, dtype=dtype, keepdims=keepdims), [self], "sum")

    def all(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> ndarray:
        if out is not None:
            raise NotImplementedError("fake_cupy: all(out=...)")
        return _kernel(lambda a: np.all(a, axis=axis, keepdims=keepdims), [self], "all")

    def any(self, axis: Any = None, out: Any = None, keepdims: bool = False) -> ndarray:
        if out is not None:
            raise NotImplementedError("fake_cupy: any(out=...)")
        return _kernel(lambda a: np.any(a, axis=axis, keepdims=keepdims), [self], "any")

    def astype(self, dtype: Any, copy: bool = True) -> ndarray:
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _kernel(lambda a: a.astype(dtype), [self], "astype")

    def _binary(self, ufunc: Any, other: Any) -> ndarray:
        return _kernel(ufunc, [self, other], ufunc.__name__)

    def _inplace(self, ufunc: Any, other: Any) -> ndarray:
        if isinstance(other, np.ndarray) and other.ndim:  # CuPy refuses implicit host -> device conversion
            raise TypeError(f"Unsupported type {type(other)}")
        sample = np.zeros((), dtype=other.dtype) if isinstance(other, ndarray) else other
        ufunc(np.zeros((), dtype=self.dtype), sample, out=np.zeros((), dtype=self.dtype))  # a cast numpy refuses raises now
        if np.broadcast_shapes(self.shape, np.shape(other)) != self.shape:
            raise ValueError(f"non-broadcastable output operand with shape {self.shape}")
        dst = self
        sim().current_stream(self._device).enqueue(
            lambda: ufunc(dst._h, other._h if isinstance(other, ndarray) else other, out=dst._h), ufunc.__name__
        )
        return self

    def __add__(self, other: Any) -> ndarray:
        return self._binary(np.add, other)

    def __sub__(self, other: Any) -> ndarray:
        return self._binary(np.subtract, other)

    def __mul__(self, other: Any) -> ndarray:
        return self._binary(np.multiply, other)

    def __truediv__(self, other: Any) -> ndarray:
        return self._binary(np.true_divide, other)

    __radd__, __rmul__ = __add__, __mul__

    def __iadd__(self, other: Any) -> ndarray:
        return self._inplace(np.add, other)

    def __isub__(self, other: Any) -> ndarray:
        return self._inplace(np.subtract, other)

    def __imul__(self, other: Any) -> ndarray:
        return self._inplace(np.multiply, other)

    def __itruediv__(self, other: Any) -> ndarray:
        return self._inplace(np.true_divide, other)

    def __eq__(self, other: object) -> ndarray:  # type: ignore[override]
        return self._binary(np.equal, other)

    def __ne__(self, other: object) -> ndarray:  # type: ignore[override]
        return self._binary(np.not_equal, other)

    __hash__ = None  # type: ignore[assignment]  # unhashable, as cupy.ndarray (and numpy's)

    # to the host (a synchronous copy on the current stream, as CuPy's)
    def _scalar(self) -> Any:
        if self.size != 1:
            raise TypeError("only length-1 arrays can be converted to Python scalars")
        return self.get().reshape(())[()]

    def __float__(self) -> float:
        return float(self._scalar())

    def __int__(self) -> int:
        return int(self._scalar())

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is ambiguous. Use a.any() or a.all()")
        return bool(self._scalar())

    def item(self) -> Any:
        return self._scalar().item()


def _from_host(a: Any, dtype: Any = None) -> ndarray:
    h = np.asarray(a, dtype=dtype)
    out = ndarray(h.shape, h.dtype)
    out.set(h if h.flags.c_contiguous else h.copy(order="C"))  # not ascontiguousarray: it makes a 0-d array 1-d
    return out


def asarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    if isinstance(a, ndarray):
        out = ndarray(a.shape, dtype)
        s = sim().current_stream(a._device)
        s.enqueue(lambda: np.copyto(out._h, a._h, casting="unsafe"), "astype")
        return out
    iface = getattr(type(a), "__cuda_array_interface__", None)
    if iface is not None:  # a zero-copy view of someone else's device memory
        d = a.__cuda_array_interface__
        dt = np.dtype(d["typestr"])
        shape = tuple(d["shape"])
        n = int(np.prod(shape, dtype=np.int64))
        ptr = d["data"][0]
        got = sim().lookup(ptr, n * dt.itemsize)
        if got is None or got[0] != "device":
            raise ValueError(f"__cuda_array_interface__ pointer {ptr:#x} is not device memory")
        buf = (ctypes.c_char * (n * dt.itemsize)).from_address(ptr)
        h = np.frombuffer(buf, dtype=dt).reshape(shape)
        view = ndarray(0, _base=h, _device=got[1])
        view._raw = a
        return view
    return _from_host(a, dtype)


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    a = asarray(a, dtype)
    if a.flags.c_contiguous:
        return a
    out = ndarray(a.shape, a.dtype, _device=a._device)
    sim().current_stream(a._device).enqueue(lambda: np.copyto(out._h, a._h), "ascontiguousarray")
    return out


def empty(shape: Any, dtype: Any = float) -> ndarray:
    return ndarray(shape, dtype)


def zeros(shape: Any, dtype: Any = float) -> ndarray:
    out = ndarray(shape, dtype)
    sim().current_stream(out._device).enqueue(lambda: out._h.fill(0), "zeros")
    return out


def ones(shape: Any, dtype: Any = float) -> ndarray:
    out = ndarray(shape, dtype)
    sim().current_stream(out._device).enqueue(lambda: out._h.fill(1), "ones")
    return out


def full(shape: Any, fill_value: Any, dtype: Any = None) -> ndarray:
    """``cupy.full``: ``dtype`` None is ``numpy.array(fill_value).dtype``, as CuPy's."""
    out = ndarray(shape, np.array(fill_value).dtype if dtype is None else dtype)
    out.fill(fill_value)
    return out


def arange(start: Any, stop: Any = None, step: Any = 1, dtype: Any = None) -> ndarray:
    """``cupy.arange`` (numpy's values and dtype rules; made on the current stream)."""
    h = np.arange(start, stop, step, dtype=dtype) if stop is not None else np.arange(start, step=step, dtype=dtype)
    out = ndarray(h.shape, h.dtype)
    dst = out
    sim().current_stream(out._device).enqueue(lambda: np.copyto(dst._h, h), "arange")
    return out


def _kernel(fn: Callable[..., Any], args: list[Any], what: str) -> ndarray:
    """A kernel making a new array from ``args`` (fake ndarrays or host scalars) on the current
    stream: its shape and dtype are worked out now (errors at the call), the values when it runs."""
    dev = next((a._device for a in args if isinstance(a, ndarray)), sim().current_device())
    for a in args:
        if isinstance(a, np.ndarray) and a.ndim:  # CuPy refuses implicit host -> device conversion
            raise TypeError(f"Unsupported type {type(a)}")
    probe = fn(*(np.broadcast_to(np.zeros((), dtype=a.dtype), a.shape) if isinstance(a, ndarray) else a for a in args))
    probe = np.asarray(probe)
    out = ndarray(probe.shape, probe.dtype, _device=dev)

    def run() -> None:
        out._h[...] = fn(*(a._h if isinstance(a, ndarray) else a for a in args))

    sim().current_stream(dev).enqueue(run, what)
    return out


def empty_pinned(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
    """``cupyx.empty_pinned``: a numpy array in (registered) pinned host memory."""
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(max(n, 1), dtype=np.uint8)
    out = raw[:n].view(dt).reshape(shape)
    sim().register(raw, "pinned", -1, keep=None)  # alive as long as ``out`` (its numpy base)
    return out


# -- streams and events -------------------------------------------------------------------------------


class Stream:
    """``cupy.cuda.Stream``: a FIFO of work run in order by a worker thread while it has work."""

    def __init__(
        self,
        null: bool = False,
        non_blocking: bool = False,
        ptds: bool = False,
        priority: int | None = None,
        *,
        _null_device: int | None = None,
    ) -> None:
        s = sim()
        self.non_blocking = non_blocking
        self.priority = priority
        self._q: collections.deque[tuple[Callable[[], None], str]] = collections.deque()
        self._lock = threading.Lock()
        self._running = False
        self._prev: list[Stream] = []
        if _null_device is not None:
            self.device_id = _null_device
            self.ptr = 0
            return
        self.device_id = s.current_device()
        with s.lock:
            s._next_stream += 0x10
            self.ptr = s._next_stream
            s.streams[self.ptr] = self

    def enqueue(self, fn: Callable[[], None], what: str) -> None:
        with self._lock:
            self._q.append((fn, what))
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._work, name=f"fake-cuda-stream-{self.ptr:#x}", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._q:
                    self._running = False
                    return
                fn, _what = self._q.popleft()
            try:
                fn()  # NCCL work records its errors on the communicator; anything else is a simulator failure
            except Exception as exc:
                if _sim is not None:
                    _sim.unexpected.append(f"stream {self.ptr:#x}: {_what} failed: {exc!r}")

    def record(self, event: Event | None = None) -> Event:
        ev = event if event is not None else Event()
        ev.record(self)
        return ev

    def wait_event(self, event: Event) -> None:
        mark = event._mark
        if mark is not None:
            self.enqueue(lambda: _wait_mark(mark, "wait_event"), "wait_event")

    def synchronize(self) -> None:
        mark = threading.Event()
        self.enqueue(mark.set, "synchronize")
        _wait_mark(mark, "stream synchronize")

    def launch_host_func(self, callback: Callable[[Any], None], arg: Any) -> None:
        self.enqueue(lambda: callback(arg), "host function")

    @property
    def done(self) -> bool:
        with self._lock:
            return not self._q and not self._running

    def use(self) -> Stream:
        cur = getattr(sim().local, "streams", None)
        if cur is None:
            cur = sim().local.streams = {}
        cur[self.device_id] = self
        return self

    def __enter__(self) -> Stream:
        self._prev.append(sim().current_stream(self.device_id))
        self.use()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prev.pop().use()


def _wait_mark(mark: threading.Event, what: str) -> None:
    if not mark.wait(_WAIT_S):
        raise RuntimeError(f"fake_cupy: {what} waited more than {_WAIT_S:g} s")


class Event:
    """``cupy.cuda.Event``: a point of a stream; ``done`` once the stream got past it."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self.block = block
        self.disable_timing = disable_timing
        self._mark: threading.Event | None = None
        self.device_id = sim().current_device()

    def record(self, stream: Stream | None = None) -> None:
        s = stream if stream is not None else sim().current_stream()
        if s.device_id != self.device_id:
            raise CUDARuntimeError(400, f"event of cuda:{self.device_id} recorded on a stream of cuda:{s.device_id}")
        mark = threading.Event()
        self._mark = mark
        s.enqueue(mark.set, "event")

    def synchronize(self) -> None:
        if self._mark is not None:
            _wait_mark(self._mark, "event synchronize")

    @property
    def done(self) -> bool:
        return self._mark is None or self._mark.is_set()


def get_current_stream(device_id: int | None = None) -> Stream:
    return sim().current_stream(device_id)


# -- the runtime -----------------------------------------------------------------------------------------

_KINDS = {0: (("pinned", "host"), ("pinned", "host")), 1: (("device",), ("pinned", "host")), 2: (("pinned", "host"), ("device",))}
_KINDS[3] = (("device",), ("device",))
_KINDS[4] = (("device", "pinned", "host"), ("device", "pinned", "host"))


def _runtime_module() -> types.ModuleType:
    rt = types.ModuleType("cupy.cuda.runtime")
    rt.CUDARuntimeError = CUDARuntimeError  # type: ignore[attr-defined]
    rt.memcpyDeviceToDevice = 3  # type: ignore[attr-defined]

    def getDevice() -> int:  # noqa: N802 - CUDA's name
        return sim().current_device()

    def getDeviceCount() -> int:  # noqa: N802
        return sim().device_count

    def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:  # noqa: N802
        s = sim()
        if kind not in _KINDS:
            raise CUDARuntimeError(21, f"bad memcpy kind {kind}")
        dkinds, skinds = _KINDS[kind]
        for ptr, kinds, what in ((dst, dkinds, "dst"), (src, skinds, "src")):
            if size and (s.lookup(ptr, size) or ("host", -1))[0] not in kinds:
                raise CUDARuntimeError(1, f"memcpyAsync {what} {ptr:#x} ({size} bytes) is not {'/'.join(kinds)} memory")
        s.calls["memcpyAsync"] += 1

        def copy() -> None:
            for ptr, kinds in ((dst, dkinds), (src, skinds)):  # still alive when the copy runs
                if size and (s.lookup(ptr, size) or ("host", -1))[0] not in kinds:
                    raise CUDARuntimeError(700, f"memcpyAsync: {ptr:#x} was freed before the copy ran")
            ctypes.memmove(dst, src, size)

        s.stream_of(stream).enqueue(copy, "memcpyAsync")

    rt.getDevice = getDevice  # type: ignore[attr-defined]
    rt.getDeviceCount = getDeviceCount  # type: ignore[attr-defined]
    rt.memcpyAsync = memcpyAsync  # type: ignore[attr-defined]
    return rt


# -- NCCL ----------------------------------------------------------------------------------------------


def _view(ptr: int, count: int, dtype: int) -> np.ndarray:
    """``count`` elements of NCCL type ``dtype`` at ``ptr``, writable."""
    dt = np.dtype(_NCCL_NP[dtype])
    if count == 0:
        return np.empty(0, dtype=dt)
    sim().check_ptr(ptr, count * dt.itemsize, ("device",), "a kernel (the array was freed while the op ran?)")
    buf = (ctypes.c_char * (count * dt.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dt)


class _Gone(Exception):
    """A peer left (aborted or destroyed) or this rank's communicator was aborted."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class _Slot:
    """The k-th collective of a clique: each rank's description and input snapshot."""

    def __init__(self) -> None:
        self.desc: dict[int, tuple[Any, ...]] = {}
        self.data: dict[int, Any] = {}
        self.left = 0


class _Clique:
    """The communicators of one unique id across the ranks of this process."""

    def __init__(self, uid: Any) -> None:
        self.uid = uid
        self.splits: dict[int, dict[int, tuple[int, int]]] = {}  # k-th commSplit -> rank -> (color, key)
        self.n: int | None = None
        self.cond = threading.Condition()
        self.joined: dict[int, NcclCommunicator] = {}
        self.gone: dict[int, str] = {}  # rank -> why it left
        self.broken: str | None = None
        self.slots: dict[int, _Slot] = {}
        self.fifo: dict[tuple[int, int], collections.deque[bytes]] = collections.defaultdict(collections.deque)

    def break_all(self, why: str) -> None:
        with self.cond:
            self.broken = why
            self.cond.notify_all()

    def leave(self, rank: int, why: str) -> None:
        with self.cond:
            self.gone.setdefault(rank, why)
            self.cond.notify_all()

    def _check(self, me: int, need: Any) -> None:
        """Raise if the wait of rank ``me`` can no longer succeed (call under ``cond``)."""
        if self.broken is not None:
            raise _Gone(3, self.broken)
        if me in self.gone:
            raise _Gone(3, f"rank {me}'s communicator {self.gone[me]}")
        for r in need:
            if r in self.gone:
                raise _Gone(6, f"rank {r} {self.gone[r]}")

    def wait(self, me: int, ready: Callable[[], bool], need: Any, what: str) -> None:
        with self.cond:
            while True:
                if ready():
                    return
                self._check(me, need)
                if not self.cond.wait(_WAIT_S):
                    raise _Gone(3, f"{what}: the simulator waited {_WAIT_S:g} s")

    def meet(self, me: int, k: int, desc: tuple[Any, ...], data: Any) -> _Slot:
        """Rank ``me``'s k-th collective: wait for every rank's, then return the slot."""
        assert self.n is not None
        with self.cond:
            slot = self.slots.setdefault(k, _Slot())
            slot.desc[me] = desc
            slot.data[me] = data
            self.cond.notify_all()
        n = self.n
        self.wait(me, lambda: len(slot.desc) == n, range(n), f"collective {k} ({desc[0]})")
        return slot

    def done_with(self, k: int, slot: _Slot) -> None:
        with self.cond:
            slot.left += 1
            if slot.left == self.n:
                self.slots.pop(k, None)


def _reduce(arrays: list[np.ndarray], op: int, factors: list[float | None]) -> np.ndarray:
    dt = arrays[0].dtype
    if op == _SUM or op == _AVG or op >= _NUM_OPS:
        acc = np.zeros(arrays[0].shape, dtype=np.float64 if _floating(dt) else dt)
        for a, f in zip(arrays, factors, strict=True):
            x = a.astype(acc.dtype) if _floating(dt) else a
            acc = acc + (x * f if f is not None else x)
        if op == _AVG:
            if _floating(dt):
                acc = acc / len(arrays)
            else:  # NCCL divides an integer sum, truncating toward zero
                acc = np.sign(acc) * (np.abs(acc) // len(arrays))
        return acc.astype(dt)
    fn = {_PROD: np.multiply, _MAX: np.maximum, _MIN: np.minimum}[op]
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = fn(out, a)
    return out.astype(dt)


class NcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator``: one rank of a clique (see the module docstring)."""

    def __init__(self, ndev: int, commId: bytes, rank: int, config: Any = None) -> None:  # noqa: N803 - CuPy's name
        if not isinstance(commId, bytes):  # CuPy 14's typed signature (a tuple was CuPy 13's)
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
        s = sim()
        assert len(commId) == 128  # CuPy asserts it too
        clique = s.cliques.get(commId)
        if clique is None:
            raise NcclError(2, "unique id was not made by get_unique_id (no root to connect to)")
        self._join(clique, ndev, rank, "ncclCommInitRank")

    def _join(self, clique: _Clique, ndev: int, rank: int, what: str) -> None:
        s = sim()
        self._comm = 0
        self.rank = rank
        self.ndev = ndev
        self.device = s.current_device()
        self._async: int = 0
        self._async_why = ""
        self._k = 0  # collectives enqueued
        self._done_k = 0
        self._splits = 0
        if not 0 <= rank < ndev:
            raise NcclError(4, f"rank {rank} out of range for {ndev} ranks")
        with clique.cond:
            if clique.n is None:
                clique.n = ndev
            if clique.n != ndev:
                raise NcclError(5, f"ranks disagree on the communicator's size ({clique.n} vs {ndev})")
            if rank in clique.joined:
                raise NcclError(5, f"rank {rank} joined twice")
            clique.joined[rank] = self
            clique.cond.notify_all()
        self._clique = clique
        s.calls[what] += 1
        try:
            clique.wait(rank, lambda: len(clique.joined) == ndev, (), what)
        except _Gone as exc:
            raise NcclError(2, f"{what}: {exc}") from None
        with s.lock:
            s._next_handle += 0x10
            self._comm = s._next_handle

    @property
    def comm(self) -> int:
        return self._comm

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.ndev

    def device_id(self) -> int:
        return self.device

    def commSplit(self, color: int, key: int, config: Any = None) -> NcclCommunicator | None:  # noqa: N802 - CuPy's name
        """``ncclCommSplit``: every rank of this communicator calls it; ranks of one color form a
        new communicator, ranked by (key, old rank); color -1 takes part and gets None."""
        if not self._comm:
            raise NcclError(4, "ncclCommSplit on a destroyed or aborted communicator")
        clique, me = self._clique, self.rank
        assert clique.n is not None
        n = clique.n
        k = self._splits
        self._splits += 1
        with clique.cond:
            votes = clique.splits.setdefault(k, {})
            votes[me] = (color, key)
            clique.cond.notify_all()
        try:
            clique.wait(me, lambda: len(votes) == n, range(n), f"ncclCommSplit {k}")
        except _Gone as exc:
            raise NcclError(3, f"ncclCommSplit: {exc}") from None
        if color < 0:
            return None
        mates = sorted((kk, r) for r, (c, kk) in votes.items() if c == color)
        new_rank = [r for _, r in mates].index(me)
        s = sim()
        with clique.cond:
            child = s.cliques.setdefault((clique.uid, k, color), _Clique((clique.uid, k, color)))
        made = NcclCommunicator.__new__(NcclCommunicator)
        made._join(child, len(mates), new_rank, "ncclCommSplit")
        return made

    # -- lifetime
    def abort(self) -> None:
        if self._comm:
            sim().calls["ncclCommAbort"] += 1
            self._comm = 0
            self._clique.leave(self.rank, "was aborted")

    def destroy(self) -> None:
        if self._comm:
            sim().calls["ncclCommDestroy"] += 1
            self._comm = 0
            self._clique.leave(self.rank, "was destroyed")

    def check_async_error(self) -> None:
        if not self._comm:
            raise NcclError(4, "ncclCommGetAsyncError on a destroyed or aborted communicator")
        if self._async:
            raise NcclError(self._async, self._async_why)

    # -- calls: checked here, run on the stream
    def _valid(self, what: str, stream: int, dtype: int, peer: int | None = None) -> Stream:
        s = sim()
        s.calls[what] += 1
        if not self._comm:
            raise NcclError(4, f"{what} on a destroyed or aborted communicator")
        if dtype not in _NCCL_NP:
            raise NcclError(4, f"{what}: datatype {dtype} is not simulated")
        if peer is not None and not 0 <= peer < self.ndev:
            raise NcclError(4, f"{what}: peer/root {peer} out of range for {self.ndev} ranks")
        st = s.stream_of(stream)
        if st.device_id != self.device:
            raise NcclError(1, f"{what}: stream on cuda:{st.device_id}, communicator on cuda:{self.device}")
        return st

    def _buf(self, what: str, ptr: int, count: int, dtype: int) -> None:
        nbytes = count * np.dtype(_NCCL_NP[dtype]).itemsize
        sim().check_ptr(ptr, nbytes, ("device",), what, self.device)

    def _op(self, what: str, op: int, dtype: int) -> tuple[int, float | None]:
        if op < _NUM_OPS:
            return op, None
        factor = sim().premul.get((self._comm, op))
        if factor is None:
            raise NcclError(4, f"{what}: reduction op {op} was not made on this communicator")
        if not _floating(np.dtype(_NCCL_NP[dtype])):
            raise NcclError(4, f"{what}: PreMulSum op on an integer type")
        return op, factor

    def _submit(self, st: Stream, call: _Call) -> None:
        grp = _group_state()
        if grp.depth:
            grp.calls.append((self, st, call))
            return
        _enqueue_batch(st, [(self, call)])

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        st = self._valid("allReduce", stream, datatype)
        self._buf("allReduce sendbuf", sendbuf, count, datatype)
        self._buf("allReduce recvbuf", recvbuf, count, datatype)
        op, f = self._op("allReduce", op, datatype)
        self._submit(st, _Call("allReduce", (count, datatype, _opkind(op)), sendbuf, recvbuf, count, datatype, op, f, None))

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int) -> None:
        st = self._valid("reduce", stream, datatype, root)
        self._buf("reduce sendbuf", sendbuf, count, datatype)
        if self.rank == root:
            self._buf("reduce recvbuf", recvbuf, count, datatype)
        op, f = self._op("reduce", op, datatype)
        self._submit(st, _Call("reduce", (count, datatype, _opkind(op), root), sendbuf, recvbuf, count, datatype, op, f, root))

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int) -> None:
        st = self._valid("broadcast", stream, datatype, root)
        if self.rank == root:
            self._buf("broadcast sendbuff", sendbuff, count, datatype)
        self._buf("broadcast recvbuff", recvbuff, count, datatype)
        self._submit(st, _Call("broadcast", (count, datatype, root), sendbuff, recvbuff, count, datatype, None, None, root))

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self.broadcast(buff, buff, count, datatype, root, stream)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        st = self._valid("reduceScatter", stream, datatype)
        self._buf("reduceScatter sendbuf", sendbuf, recvcount * self.ndev, datatype)
        self._buf("reduceScatter recvbuf", recvbuf, recvcount, datatype)
        op, f = self._op("reduceScatter", op, datatype)
        call = _Call("reduceScatter", (recvcount, datatype, _opkind(op)), sendbuf, recvbuf, recvcount, datatype, op, f, None)
        self._submit(st, call)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        st = self._valid("allGather", stream, datatype)
        self._buf("allGather sendbuf", sendbuf, count, datatype)
        self._buf("allGather recvbuf", recvbuf, count * self.ndev, datatype)
        self._submit(st, _Call("allGather", (count, datatype), sendbuf, recvbuf, count, datatype, None, None, None))

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        st = self._valid("send", stream, datatype, peer)
        self._buf("send sendbuf", sendbuf, count, datatype)
        self._submit(st, _Call("send", (), sendbuf, 0, count, datatype, None, None, peer))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        st = self._valid("recv", stream, datatype, peer)
        self._buf("recv recvbuf", recvbuf, count, datatype)
        self._submit(st, _Call("recv", (), 0, recvbuf, count, datatype, None, None, peer))

    # -- running on the stream
    def _fail(self, status: int, why: str, unexpected: bool) -> None:
        if not self._async:
            self._async, self._async_why = status, why
        if unexpected:
            sim().unexpected.append(f"rank {self.rank}: {why}")

    def _collective(self, c: _Call, k: int) -> None:
        n = self.ndev
        src: Any = None
        if c.name in ("allReduce", "reduce", "allGather"):
            src = _view(c.send, c.count, c.dtype).copy()
        elif c.name == "reduceScatter":
            src = _view(c.send, c.count * n, c.dtype).copy()
        elif c.name == "broadcast" and self.rank == c.peer:
            src = _view(c.send, c.count, c.dtype).copy()
        clique = self._clique
        slot = clique.meet(self.rank, k, (c.name, *c.desc), (src, c.factor))
        try:
            descs = {slot.desc[r] for r in range(n)}
            if len(descs) != 1:
                why = f"collective {k}: ranks made different calls: {sorted(map(str, descs))}"
                if sim().hang_on_error:  # as a real kernel: the error is set, the kernel never ends
                    self._fail(5, why, True)
                    clique.wait(self.rank, lambda: False, (), why)
                raise _Gone(5, why)
            ins = [slot.data[r][0] for r in range(n)]
            factors = [slot.data[r][1] for r in range(n)]
            if c.name == "allReduce" or (c.name == "reduce" and self.rank == c.peer):
                _view(c.recv, c.count, c.dtype)[:] = _reduce(ins, c.op, factors)  # type: ignore[arg-type]
            elif c.name == "reduceScatter":
                parts = [a[self.rank * c.count : (self.rank + 1) * c.count] for a in ins]
                _view(c.recv, c.count, c.dtype)[:] = _reduce(parts, c.op, factors)  # type: ignore[arg-type]
            elif c.name == "broadcast":
                _view(c.recv, c.count, c.dtype)[:] = ins[c.peer]  # type: ignore[index]
            elif c.name == "allGather":
                _view(c.recv, c.count * n, c.dtype)[:] = np.concatenate(ins)
        finally:
            clique.done_with(k, slot)


def _opkind(op: int) -> str:
    return "premul" if op >= _NUM_OPS else str(op)


class _Call:
    __slots__ = ("name", "desc", "send", "recv", "count", "dtype", "op", "factor", "peer")

    def __init__(
        self,
        name: str,
        desc: tuple[Any, ...],
        send: int,
        recv: int,
        count: int,
        dtype: int,
        op: int | None,
        factor: float | None,
        peer: int | None,
    ) -> None:
        self.name, self.desc, self.send, self.recv, self.count = name, desc, send, recv, count
        self.dtype, self.op, self.factor, self.peer = dtype, op, factor, peer


def _enqueue_batch(st: Stream, calls: list[tuple[NcclCommunicator, _Call]]) -> None:
    """One group call's work on stream ``st``: sends, then collectives, then receives."""
    ks: list[int] = []
    for comm, c in calls:  # collectives are numbered at enqueue, in call order
        if c.name not in ("send", "recv"):
            ks.append(comm._k)
            comm._k += 1

    def run() -> None:
        kit = iter(ks)
        failed: set[int] = set()
        for comm, c in calls:
            if c.name == "send":
                data = _view(c.send, c.count, c.dtype).tobytes()
                with comm._clique.cond:
                    comm._clique.fifo[(comm.rank, c.peer)].append(data)  # type: ignore[index]
                    comm._clique.cond.notify_all()
        for comm, c in calls:
            if c.name in ("send", "recv"):
                continue
            k = next(kit)
            if id(comm) in failed:
                continue
            try:
                comm._collective(c, k)
            except _Gone as exc:
                failed.add(id(comm))
                comm._fail(exc.status, f"{c.name}: {exc}", exc.status == 5)
        for comm, c in calls:
            if c.name != "recv" or id(comm) in failed:
                continue
            clique, key = comm._clique, (c.peer, comm.rank)
            try:
                clique.wait(comm.rank, lambda key=key, clique=clique: bool(clique.fifo[key]), (c.peer,), f"recv from {c.peer}")  # type: ignore[misc]
                with clique.cond:
                    data = clique.fifo[key].popleft()  # type: ignore[index]
                want = c.count * np.dtype(_NCCL_NP[c.dtype]).itemsize
                if len(data) != want:
                    raise _Gone(5, f"recv from {c.peer}: {want} bytes expected, the matching send had {len(data)}")
                if want:
                    ctypes.memmove(c.recv, data, want)
            except _Gone as exc:
                failed.add(id(comm))
                comm._fail(exc.status, f"recv: {exc}", exc.status == 5)

    st.enqueue(run, "nccl")


class _GroupState(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.calls: list[tuple[NcclCommunicator, Stream, _Call]] = []


_GROUP = _GroupState()


def _group_state() -> _GroupState:
    return _GROUP


def groupStart() -> None:  # noqa: N802 - NCCL's name
    sim().calls["groupStart"] += 1
    _GROUP.depth += 1


def groupEnd() -> None:  # noqa: N802
    sim().calls["groupEnd"] += 1
    if _GROUP.depth == 0:
        raise NcclError(5, "groupEnd without groupStart")
    _GROUP.depth -= 1
    if _GROUP.depth:
        return
    calls, _GROUP.calls = _GROUP.calls, []
    by_stream: dict[int, tuple[Stream, list[tuple[NcclCommunicator, _Call]]]] = {}
    for comm, st, c in calls:
        by_stream.setdefault(id(st), (st, []))[1].append((comm, c))
    for st, batch in by_stream.values():
        _enqueue_batch(st, batch)


def get_unique_id() -> bytes:
    s = sim()
    uid = os.urandom(128)  # bytes, as CuPy 14 returns it (CuPy 13: a tuple of C chars)
    s.cliques[uid] = _Clique(uid)
    s.calls["get_unique_id"] += 1
    return uid


def get_version() -> int:
    return 23203


# -- PREMUL_SUM ---------------------------------------------------------------------------------------


class FakePreMul:
    """Stands in for aiodist_cuda._ops._PreMul: ops the simulated communicators understand."""

    def __init__(self) -> None:
        self.made = 0
        self.live: set[tuple[int, int]] = set()
        self._next = _NUM_OPS

    def create(self, comm_handle: int, factor: float, arr: Any) -> int:
        if not comm_handle:
            raise NcclError(4, "ncclRedOpCreatePreMulSum on a NULL communicator")
        op = self._next
        self._next += 1
        sim().premul[(comm_handle, op)] = float(np.asarray(factor, dtype=np.dtype(arr.dtype)))  # the scalar in the array's type
        self.live.add((comm_handle, op))
        self.made += 1
        return op

    def destroy(self, op: int, comm_handle: int) -> None:
        sim().premul.pop((comm_handle, op), None)
        self.live.discard((comm_handle, op))


# -- installing it ------------------------------------------------------------------------------------


class Installed:
    """What ``install`` put in place: the modules and the state of this test's machine."""

    def __init__(self, sim_: Sim, cupy: types.ModuleType, nccl: types.ModuleType, cupyx: types.ModuleType, premul: FakePreMul) -> None:
        self.sim, self.cupy, self.nccl, self.cupyx, self.premul = sim_, cupy, nccl, cupyx, premul


def make_modules() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    cupyx = types.ModuleType("cupyx")
    for name in ("ndarray", "asarray", "ascontiguousarray", "empty", "zeros", "ones", "full", "arange"):
        setattr(cupy, name, globals()[name])
    for name in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"):
        setattr(cupy, name, getattr(np, name))
    cupy.bool_ = np.bool_  # type: ignore[attr-defined]
    cupy.complex64, cupy.complex128 = np.complex64, np.complex128  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    cuda.Device, cuda.Stream, cuda.Event = Device, Stream, Event  # type: ignore[attr-defined]
    cuda.get_current_stream = get_current_stream  # type: ignore[attr-defined]
    cuda.runtime = _runtime_module()  # type: ignore[attr-defined]
    cuda.nccl = nccl  # type: ignore[attr-defined]
    for name in ("NcclCommunicator", "NcclError", "groupStart", "groupEnd", "get_unique_id", "get_version"):
        setattr(nccl, name, globals()[name])
    nccl.available = True  # type: ignore[attr-defined]
    cupyx.empty_pinned = empty_pinned  # type: ignore[attr-defined]
    return cupy, nccl, cupyx


def install(monkeypatch: Any, device_count: int = 1) -> Installed:
    """Install the simulator for one test (undone by ``monkeypatch``; call ``uninstall`` too)."""
    global _sim
    import aiodist_cuda._ops as ops
    from aiodist_cuda import _cupy

    s = Sim(device_count)
    _sim = s
    cupy, nccl, cupyx = make_modules()
    monkeypatch.setitem(__import__("sys").modules, "cupy", cupy)
    monkeypatch.setitem(__import__("sys").modules, "cupy.cuda", cupy.cuda)
    monkeypatch.setitem(__import__("sys").modules, "cupy.cuda.nccl", nccl)
    monkeypatch.setitem(__import__("sys").modules, "cupyx", cupyx)
    monkeypatch.setitem(_cupy._state, "probe", (cupy, nccl, ""))
    pm = FakePreMul()
    monkeypatch.setattr(ops, "_PREMUL", [pm])
    return Installed(s, cupy, nccl, cupyx, pm)


def uninstall() -> None:
    """Break whatever still waits in the simulator and forget it."""
    global _sim
    if _sim is not None:
        _sim.shutdown()
    _sim = None
