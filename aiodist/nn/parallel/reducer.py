"""DDP's gradient reducer on plain parameter lists: numpy arrays or torch CPU tensors.

``Reducer(params)`` packs the parameters' gradients into flat buckets (``_buckets``: reverse
registration order, a small first bucket, then ``bucket_cap_mb``). A training step is:

1. ``reducer.ready(i, grad)`` for each gradient as backward produces it (synchronous: it is
   called from autograd hooks, or from a hand-written backward). The gradient is written into
   its bucket, divided by the group size on the way (torch's order: the sum of the quotients),
   and when a bucket is complete its ``all_reduce`` is issued with ``async_op=True`` at once, so
   it is on the wire while backward goes on. Buckets are issued strictly in bucket order, on
   every rank, whatever order their gradients arrive in: that is what keeps the ranks' sequence
   numbers in step.
2. ``await reducer.finish()`` issues whatever is still open (a parameter that got no gradient
   contributes zeros, so no peer waits for it), awaits every bucket and returns the indices of
   the parameters that got no gradient. ``reducer.grad_view(i)`` is then parameter ``i``'s averaged
   gradient, a view into its bucket.

With ``reducer.direct`` set (DDP's default, ``gradient_as_bucket_view=False``), a bucket whose
every gradient came (at most ``_FEW`` of them, contiguous, of the bucket's dtype, not its slot:
many small ones are copied back faster by one foreach call) is reduced straight into
those gradients (``aiodist.c10d.all_reduce_into``): after ``finish`` they hold the averages, the
bucket is scratch, and :attr:`Reducer.written` names their parameters, which need no copy back.
Where the op reads its peers by single copy, that spares a pass over the bucket's bytes.

A comm hook (``register_comm_hook(state, hook)``) replaces the default division + ``all_reduce``:
it gets a :class:`GradBucket` whose buffer holds the plain (undivided) gradients and returns an
awaitable (a coroutine, a ``Work``, an ``all_reduce(..., async_op=True)`` handle) of the reduced
buffer or of a list holding it. A coroutine hook's first step runs at once, so the collectives
it issues take their sequence numbers in bucket order too.

With ``find_unused_parameters=True`` a step also all-reduces which parameters were used
anywhere (torch's ``local_used_map``), after the buckets; :attr:`Reducer.globally_unused` then
names the ones no rank used.

Torch is never imported here: a tensor's methods are reached through the parameters given.
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiodist._pending import Pending
from aiodist.c10d import ProcessGroup, all_reduce, all_reduce_into, get_world_size
from aiodist.debug import record_comm
from aiodist.nn.parallel._buckets import assign_buckets, bucket_limits, reverse_order
from aiodist.types import ReduceOp, is_torch_tensor

__all__ = ["GradBucket", "Reducer"]

log = logging.getLogger("aiodist.ddp")


class _Ops:
    """What both kinds of array answer alike."""

    @staticmethod
    def dtype(p: Any) -> Any:
        return p.dtype

    @staticmethod
    def shape(p: Any) -> tuple[int, ...]:
        return tuple(p.shape)


class _NumpyOps(_Ops):
    """Array operations on numpy parameters."""

    @staticmethod
    def flat(like: Any, n: int) -> Any:
        return np.zeros(n, dtype=like.dtype)

    @staticmethod
    def view(flat: Any, off: int, n: int, shape: tuple[int, ...]) -> Any:
        return flat[off : off + n].reshape(shape)

    @staticmethod
    def scale_into(dst: Any, src: Any, factor: float) -> None:
        np.multiply(src, factor, out=dst)

    @staticmethod
    def copy_into(dst: Any, src: Any) -> None:
        np.copyto(dst, np.asarray(src).reshape(dst.shape), casting="unsafe")

    @staticmethod
    def zero(dst: Any) -> None:
        dst.fill(0)

    @staticmethod
    def cat_scaled(flat: Any, views: list[Any], grads: list[Any], factor: float | None) -> None:
        for view, g in zip(views, grads):  # a gradient that is its slot is copied onto itself
            np.copyto(view, np.asarray(g).reshape(view.shape), casting="unsafe")
        if factor is not None:
            np.multiply(flat, factor, out=flat)

    @staticmethod
    def same(a: Any, b: Any) -> bool:
        return a is b or (a.size > 0 and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])

    @staticmethod
    def nbytes(p: Any) -> int:
        return int(p.nbytes)

    @staticmethod
    def host_contiguous(p: Any) -> bool:
        return bool(p.flags.c_contiguous)


#: up to this many gradients a bucket is filled by one mul_out each (24 MiB in 10 gradients: 1.1
#: ms against 1.6 for a copy and a scale); more, by one foreach copy and one scale
_FEW = 16


class _TorchOps(_Ops):
    """The same on torch tensors, with torch's own kernels (so the bits are torch DDP's)."""

    @staticmethod
    def flat(like: Any, n: int) -> Any:
        return sys.modules["torch"].zeros(n, dtype=like.dtype, device=like.device)

    @staticmethod
    def view(flat: Any, off: int, n: int, shape: tuple[int, ...]) -> Any:
        return flat[off : off + n].view(shape)

    @staticmethod
    def scale_into(dst: Any, src: Any, factor: float) -> None:
        # torch's Reducer: at::mul_out(bucket_view, grad, 1/world_size), one pass for copy and scale
        sys.modules["torch"].mul(src, factor, out=dst)

    @staticmethod
    def copy_into(dst: Any, src: Any) -> None:
        dst.copy_(src.reshape(dst.shape) if hasattr(src, "reshape") else src)

    @staticmethod
    def zero(dst: Any) -> None:
        dst.zero_()

    @staticmethod
    def cat_scaled(flat: Any, views: list[Any], grads: list[Any], factor: float | None) -> None:
        # a few (big) gradients: torch's own mul_out per gradient, one pass over the bytes;
        # many (small) ones: one copy (a single foreach call: half of what torch.cat of reshaped
        # gradients costs on hundreds of them) and one scale for the whole bucket, which spares
        # a call per gradient. x * factor rounds once either way: the bits are torch DDP's.
        torch = sys.modules["torch"]
        if factor is not None and len(grads) <= _FEW:
            for view, grad in zip(views, grads, strict=True):
                torch.mul(grad, factor, out=view)
            return
        torch._foreach_copy_(views, grads)
        if factor is not None:
            flat.mul_(factor)

    @staticmethod
    def same(a: Any, b: Any) -> bool:
        return a is b or (a.numel() > 0 and a.data_ptr() == b.data_ptr())

    @staticmethod
    def nbytes(p: Any) -> int:
        return int(p.numel() * p.element_size())

    @staticmethod
    def host_contiguous(p: Any) -> bool:
        return bool(p.is_contiguous()) and p.device.type == "cpu"  # all_reduce_into reads and writes host memory


class GradBucket:
    """One bucket as a comm hook sees it (torch's ``dist.GradBucket``)."""

    __slots__ = ("_index", "_buffer", "_params", "_grads", "_last")

    def __init__(self, index: int, buffer: Any, params: list[Any], grads: list[Any], last: bool) -> None:
        self._index, self._buffer, self._params, self._grads, self._last = index, buffer, params, grads, last

    def index(self) -> int:
        """This bucket's index; bucket 0 is reduced first."""
        return self._index

    def buffer(self) -> Any:
        """The flat 1-D buffer of the bucket's gradients (the hook may change it in place)."""
        return self._buffer

    def set_buffer(self, buffer: Any) -> None:
        """Make ``buffer`` this bucket's buffer for the rest of the hook (torch's: a compressing
        wrapper swaps in a half-precision copy); what the hook returns is what DDP keeps."""
        self._buffer = buffer

    def gradients(self) -> list[Any]:
        """The gradients of :meth:`parameters`, as views into :meth:`buffer`."""
        return list(self._grads)

    def parameters(self) -> list[Any]:
        """The parameters of this bucket, in bucket order."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the bucket reduced last in a step."""
        return self._last

    def __repr__(self) -> str:
        return f"<GradBucket {self._index} of {len(self._params)} parameters{' (last)' if self._last else ''}>"


@dataclass
class _Bucket:
    index: int
    members: list[int]  # parameter indices, in bucket order
    flat: Any
    views: list[Any]  # one per member, shaped as the parameter
    batched: bool = False  # many small gradients: copied with one cat instead of one call each
    grads: list[Any] = field(default_factory=list)  # this step's gradients (None: none came)
    missing: int = 0
    filled: bool = False  # set last, after the gradients are written: the loop issues only then
    issued: bool = False
    handle: Any = None  # what finish() awaits
    issued_at: float = 0.0
    done_at: float = 0.0
    marks: list[bool] = field(default_factory=list)
    dests: list[Any] | None = None  # this step's gradients, where the reduction goes straight into them (Reducer.direct)


Hook = Callable[[Any, GradBucket], Any]

#: a bucket whose gradients average fewer bytes than this is filled by one cat (per-call cost
#: dominates there); bigger gradients are scaled into their slots one by one (one pass, not two)
_BATCH_BELOW = 64 * 1024


class Reducer:
    """Gradient buckets for ``params`` and their all-reduces (see the module docstring)."""

    def __init__(
        self,
        params: Sequence[Any],
        *,
        process_group: ProcessGroup | int | None = None,
        bucket_cap_mb: float | None = None,
        names: Sequence[str] | None = None,
        find_unused_parameters: bool = False,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("Reducer needs at least one parameter")
        torch_params = [is_torch_tensor(p) for p in params]
        if all(torch_params):
            self._ops: Any = _TorchOps
        elif not any(torch_params) and all(isinstance(p, np.ndarray) for p in params):
            self._ops = _NumpyOps
        else:
            kinds = sorted({type(p).__name__ for p in params})
            raise TypeError(f"Reducer parameters must be all numpy arrays or all torch tensors, got {kinds}")
        if names is not None and len(names) != len(params):
            raise ValueError(f"{len(names)} names for {len(params)} parameters")
        self.params = params
        self.names = list(names) if names is not None else [f"params[{i}]" for i in range(len(params))]
        self.process_group = process_group
        self.world_size = get_world_size(process_group)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.limits = bucket_limits(bucket_cap_mb)
        ops = self._ops
        order = reverse_order(len(params))
        groups = assign_buckets([ops.nbytes(p) for p in params], [ops.dtype(p) for p in params], self.limits, order)
        self.buckets: list[_Bucket] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * len(params)  # param -> (bucket, position in it)
        for b, members in enumerate(groups):
            flat = ops.flat(params[members[0]], sum(_numel(ops.shape(params[i])) for i in members))
            views = self._views(flat, members)
            for pos, i in enumerate(members):
                self._where[i] = (b, pos)
            batched = len(members) > 8 and ops.nbytes(flat) < _BATCH_BELOW * len(members)
            self.buckets.append(_Bucket(b, members, flat, views, batched))
        self._param_views: list[Any] | None = None  # grad_views(), built on first use
        self._hook: Hook | None = None
        self._hook_state: Any = None
        #: set during a step's backward: hands the issuing to the loop's thread (from a worker
        #: thread), and keeps a comm hook's error for finish()
        self.post: Callable[[Callable[[], None]], Any] | None = None
        self._issue_error: BaseException | None = None
        self._active = False
        self._next = 0
        self._used = np.zeros(len(params), np.int32)
        self.globally_unused: set[int] = set()
        self.first_issue: float = 0.0
        self.last_done: float = 0.0
        #: reduce a bucket straight into its gradients where it can (the module docstring)
        self.direct = False
        # handles of abandoned steps' ops that still write into the gradients (direct buckets):
        # awaited before the next step's backward writes them (settle_late)
        self._late: list[Any] = []
        #: after finish(): the parameters whose gradients hold their averages already
        self.written: set[int] = set()

    # -- set-up ------------------------------------------------------------------------------------

    @property
    def bucket_sizes(self) -> list[int]:
        """Each bucket's size in bytes, in reduction order."""
        return [self._ops.nbytes(b.flat) for b in self.buckets]

    def register_comm_hook(self, state: Any, hook: Hook) -> None:
        """Reduce every bucket with ``hook(state, bucket)`` instead of the default all_reduce."""
        if not callable(hook):
            raise TypeError(f"comm hook must be callable, got {type(hook).__name__}")
        if self._hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        if self._active:
            raise RuntimeError("register_comm_hook must be called before a step starts, not during backward")
        self._hook, self._hook_state = hook, state

    @property
    def has_comm_hook(self) -> bool:
        return self._hook is not None

    # -- a step ------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True between a step's first gradient and the end of its ``finish()``."""
        return self._active

    def _begin(self) -> None:
        for b in self.buckets:
            b.missing = len(b.members)
            b.marks = [False] * len(b.members)
            b.grads = [None] * len(b.members)
            b.issued, b.filled, b.handle, b.issued_at, b.done_at, b.dests = False, False, None, 0.0, 0.0, None
        self._used[:] = 0
        self.written = set()
        self._next = 0
        self._issue_error = None
        self._active = True
        self.first_issue = self.last_done = 0.0

    def grad_view(self, i: int) -> Any:
        """Parameter ``i``'s slot in its bucket (after ``finish``: its averaged gradient)."""
        b, pos = self._where[i]
        return self.buckets[b].views[pos]

    def grad_views(self) -> list[Any]:
        """Every parameter's :meth:`grad_view`, in parameter order (one list, kept until the
        buckets get new buffers)."""
        if self._param_views is None:
            self._param_views = [self.buckets[b].views[pos] for b, pos in self._where]
        return self._param_views

    def ready(self, i: int, grad: Any) -> int:
        """Parameter ``i``'s gradient is final for this step: bucket it; issue what is complete.
        Returns how many buckets this issued (a hand-written async backward can give the loop a
        turn then, so their all-reduces start moving)."""
        if not self._active:
            self._begin()
        b, pos = self._where[i]
        bucket = self.buckets[b]
        if bucket.marks[pos]:
            raise RuntimeError(
                f"Expected to mark a variable ready only once: parameter {self.names[i]} (index {i}) got a second gradient "
                "in one step (a second backward through the same graph, or a parameter used by two reentrant backward "
                "passes); finish the step first"
            )
        if grad is not None:
            self._used[i] = 1
        bucket.grads[pos] = grad
        bucket.marks[pos] = True
        bucket.missing -= 1
        if bucket.missing:
            return 0
        self._fill(bucket)
        bucket.filled = True  # only now may the loop's thread issue it
        post = self.post
        if post is not None:  # called off the loop's thread: the loop issues it
            post(self._issue_on_loop)
            return 0
        return self._issue_ready()

    def _fill(self, bucket: _Bucket) -> None:
        """Write the bucket's gradients into it, divided by the group size unless a comm hook
        reduces it (torch: the hook gets the plain sum of local gradients)."""
        ops = self._ops
        factor = None if self._hook is not None else 1.0 / self.world_size
        grads, views = bucket.grads, bucket.views
        if bucket.batched and not any(g is None for g in grads):
            # a gradient that is its slot already (gradient_as_bucket_view) is copied onto itself,
            # which changes nothing: cheaper than asking each gradient where it lives
            ops.cat_scaled(bucket.flat, views, grads, factor)
        else:
            for grad, view in zip(grads, views):
                if grad is None:
                    ops.zero(view)
                elif factor is not None:
                    ops.scale_into(view, grad, factor)  # in place when grad is its slot
                elif not ops.same(grad, view):
                    ops.copy_into(view, grad)
        if self.direct and factor is not None and len(grads) <= _FEW and self._direct_fits(bucket.flat, grads, views):
            bucket.dests = list(grads)  # the reduction's destination: they are read, so free to write now
        bucket.grads = [None] * len(grads)  # the step keeps no other gradient alive

    def _direct_fits(self, flat: Any, grads: list[Any], views: list[Any]) -> bool:
        ops = self._ops
        kind = ops.dtype(flat)
        for grad, view in zip(grads, views):
            if grad is None or not ops.host_contiguous(grad) or ops.dtype(grad) != kind or ops.same(grad, view):
                return False
        return True

    def _issue_on_loop(self) -> None:
        try:
            self._issue_ready()
        except BaseException as exc:  # a comm hook's error: finish() raises it in the step
            if self._issue_error is None:
                self._issue_error = exc

    def mark_unused(self, indices: Sequence[int]) -> None:
        """These parameters get no gradient this step: their slots are zeros and count as ready."""
        for i in indices:
            self.ready(i, None)

    def _issue_ready(self) -> int:
        buckets = self.buckets
        start = self._next
        while self._next < len(buckets) and buckets[self._next].filled:
            bucket = buckets[self._next]
            self._next += 1
            self._issue(bucket)
        return self._next - start

    def _issue(self, bucket: _Bucket) -> None:
        bucket.issued = True
        bucket.issued_at = time.perf_counter()
        if not self.first_issue:
            self.first_issue = bucket.issued_at
        with record_comm(f"ddp bucket {bucket.index}"):
            if self._hook is None:
                if bucket.dests is not None:
                    handle: Any = all_reduce_into(bucket.flat, bucket.dests, group=self.process_group)
                else:
                    handle = all_reduce(bucket.flat, ReduceOp.SUM, group=self.process_group, async_op=True)
                work = handle.get_future()  # torch's idiom; the Work exists once the call returns
                work.add_done_callback(lambda _w, b=bucket: setattr(b, "done_at", time.perf_counter()))
            else:
                grad_bucket = GradBucket(
                    bucket.index,
                    bucket.flat,
                    [self.params[i] for i in bucket.members],
                    list(bucket.views),
                    bucket.index == len(self.buckets) - 1,
                )
                handle = self._hook(self._hook_state, grad_bucket)
                if inspect.iscoroutine(handle):  # its first step now: its collectives issue in bucket order
                    code = getattr(self._hook, "__code__", None)
                    site = (code.co_filename, code.co_firstlineno) if code is not None else ("<comm hook>", 0)
                    handle = Pending("ddp comm hook", handle, site)
                elif not inspect.isawaitable(handle):
                    raise TypeError(
                        f"comm hook {getattr(self._hook, '__name__', self._hook)!r} returned {type(handle).__name__}: "
                        "it must return an awaitable of the reduced bucket buffer (a coroutine, a Work, or "
                        "all_reduce(..., async_op=True))"
                    )
        bucket.handle = handle

    def abandon(self) -> None:
        """Give up this step (backward failed part way, or was not awaited): what was issued runs
        on in its group, into the old buffers; the buckets get new ones for the next step."""
        for b in self.buckets:
            if isinstance(b.handle, Pending):
                b.handle.is_completed()  # marks it seen: abandoning is deliberate, not a forgotten await
            if b.issued:
                self._renew(b)
            if b.dests is not None and b.handle is not None:
                self._late.append(b.handle)  # it writes the gradients when it completes: settle_late
            b.handle = None
            b.dests = None
        self._active = False

    async def settle_late(self) -> None:
        """Wait until the ops of abandoned steps that write straight into the gradients have
        ended (each by its group's timeout at the latest), so that they cannot write into the
        next step's gradients. Their errors were the abandoned step's: not raised again."""
        late, self._late = self._late, []
        for handle in late:
            try:
                await _settle(handle)
            except Exception as exc:  # the abandoned step's failure, already reported to it
                log.debug("an abandoned DDP step's all_reduce ended with %s: %s", type(exc).__name__, exc)

    def _renew(self, bucket: _Bucket) -> None:
        bucket.flat = self._ops.flat(bucket.flat, len(bucket.flat))
        bucket.views = self._views(bucket.flat, bucket.members)
        self._param_views = None

    def _views(self, flat: Any, members: list[int]) -> list[Any]:
        """Each member's slot in ``flat``, shaped as the parameter, in bucket order."""
        ops, views, off = self._ops, [], 0
        for i in members:
            shape = ops.shape(self.params[i])
            n = _numel(shape)
            views.append(ops.view(flat, off, n, shape))
            off += n
        return views

    async def finish(self) -> list[int]:
        """Issue what is left (missing gradients as zeros), await every bucket, and return the
        indices of the parameters that got no gradient this step."""
        if not self._active:
            self._begin()
        missing = sorted(i for b in self.buckets for pos, i in enumerate(b.members) if not b.marks[pos])
        try:
            self.post = None
            self.mark_unused(missing)
            self._issue_ready()  # anything a posted issue has not reached yet
            if self._issue_error is not None:
                raise self._issue_error
            for bucket in self.buckets:
                result = await _settle(bucket.handle)
                if self._hook is not None:
                    self._take(bucket, result)
                bucket.done_at = bucket.done_at or time.perf_counter()
                if bucket.dests is not None:
                    self.written.update(bucket.members)
                    bucket.dests = None
            self.last_done = max(b.done_at for b in self.buckets)
            if self.find_unused_parameters:
                used = self._used.copy()
                await (await all_reduce(used, ReduceOp.MAX, group=self.process_group, async_op=True))
                self.globally_unused = {int(i) for i in np.flatnonzero(used == 0)}
        finally:
            self._active = False
        return missing

    def _take(self, bucket: _Bucket, result: Any) -> None:
        if result is None:
            raise TypeError(
                f"comm hook {getattr(self._hook, '__name__', self._hook)!r} gave None for bucket {bucket.index}: "
                "it must give the reduced bucket buffer"
            )
        if result is bucket.flat:
            return
        n = _numel(tuple(result.shape))
        want = len(bucket.flat)
        if n != want:
            raise ValueError(f"comm hook gave {n} elements for bucket {bucket.index}, which has {want}")
        self._ops.copy_into(bucket.flat, result)


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


async def _settle(handle: Any) -> Any:
    """Await a bucket's handle down to its value: a Pending gives a Work, a Work the list of its
    outputs; a list stands for its first element (torch's ``fut.value()[0]``)."""
    value = handle
    while inspect.isawaitable(value):
        value = await value
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value
