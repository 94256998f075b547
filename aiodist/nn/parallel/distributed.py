"""``DistributedDataParallel``: torch's DDP for CPU torch modules on any aiodist process group.

The port of a torch DDP loop is ``await`` in two places::

    ddp = await DistributedDataParallel(model)   # checks the model on every rank, broadcasts rank 0's state
    for x, y in loader:
        opt.zero_grad()
        loss = loss_fn(ddp(x), y)
        await ddp.backward(loss)                 # loss.backward(); returns when every gradient is averaged
        opt.step()

How a step runs:

- ``ddp(x)`` is the module's forward (synchronous, as torch's). It first checks that the last
  step ended properly: an unawaited ``ddp.backward``, a ``loss.backward()`` called directly, and a
  step in which a parameter got no gradient (without ``find_unused_parameters``) are errors here,
  each saying what to write instead.
- ``await ddp.backward(loss)`` runs ``loss.backward()`` on a worker thread where the host has a
  core to spare for it, so the event loop stays free while autograd computes; on a host whose
  ranks already fill its cores it runs on the loop's thread (:func:`backward_on_thread` says
  which). A hook on every parameter (``register_post_accumulate_grad_hook``) hands each final
  gradient to the :class:`~aiodist.nn.parallel.reducer.Reducer`; when a bucket is complete it is
  filled there and its ``all_reduce`` is issued on the loop (from the worker thread, handed over
  with ``call_soon_threadsafe``), in bucket order, so the bytes move while backward goes on.
  When autograd returns, the call awaits the buckets, writes the
  averages into ``param.grad`` (or leaves ``param.grad`` as a view of its bucket with
  ``gradient_as_bucket_view=True``) and, with ``broadcast_buffers=True``, broadcasts rank 0's
  buffers, so the next forward sees them as torch's broadcast at the start of forward would.
- ``with ddp.no_sync():`` a forward inside it makes its backward accumulate locally; the first
  synced backward after it reduces the accumulated gradients (torch's semantics).

Debugging (``AIODIST_DEBUG`` or ``TORCH_DISTRIBUTED_DEBUG``): at INFO one "DDP Initialized with:"
line on the ``aiodist.ddp`` logger; at DETAIL also the averaged runtime statistics at
iterations 10, 20, 50 and every 100th. The buckets' all-reduces are named ``ddp bucket N`` in
the flight recorder and on the debug page. docs/ddp.md lists the differences from torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import os
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch._dynamo  # noqa: F401  # torch's optimizers import it on first use (1-2 s): here, before the event loop runs, not as a blocked loop

from aiodist._pending import trim_refusal
from aiodist.c10d import GroupMember, ProcessGroup, all_gather_object, broadcast, get_backend, get_rank, get_world_size
from aiodist.debug import DebugLevel, get_debug_level, record_comm
from aiodist.errors import DistError
from aiodist.nn.parallel.reducer import Reducer

__all__ = ["DDP", "DistributedDataParallel", "backward_on_thread", "ENV_BACKWARD"]

log = logging.getLogger("aiodist.ddp")

#: iterations after which DETAIL logs the runtime statistics (then every 100th)
_STATS_AT = (10, 20, 50)
#: module -> the DDP serving it (the last one awaited; ``_take_over``)
_SERVING: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()

_UNUSED_HINT = (
    "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates that "
    "your module has parameters that were not used in producing loss. You can enable unused parameter detection by "
    "passing the keyword argument `find_unused_parameters=True` to `aiodist.nn.parallel.DistributedDataParallel`, and by "
    "making sure all `forward` function outputs participate in calculating loss."
)


_STILL_RUNNING = (
    "the previous ddp.backward is still running: the task awaiting it was cancelled, but the step belongs to the group "
    "and ends on its own (its all-reduces must meet the other ranks'), within the group's timeout; start the next step "
    "after it has ended"
)


#: where ``ddp.backward`` runs autograd: ``thread``, ``loop`` or ``auto`` (the default)
ENV_BACKWARD = "AIODIST_DDP_BACKWARD"


def backward_on_thread(choice: str, cores: int, local_ranks: int) -> bool:
    """Whether ``ddp.backward`` runs autograd on a worker thread (True) or on the event loop's
    thread (False). ``choice`` is ``AIODIST_DDP_BACKWARD``; ``cores`` the cores this process may
    run on; ``local_ranks`` the ranks on this host. Rules, in order:

    1. ``thread``: a worker thread. The loop stays free during backward: the buckets'
       all-reduces progress while later gradients are computed, and the rank's other tasks run.
    2. ``loop``: the loop's thread. Each bucket's all-reduce is still issued the moment it is
       filled (its first step runs in the hook), the rest runs once backward returns; the loop
       runs nothing else meanwhile.
    3. ``auto`` (or unset): a thread when the host has more cores than ranks, so the thread has a
       core to run on; otherwise the loop. Where the ranks fill the cores, the communication a
       thread would overlap needs the same cores, and the thread only adds hand-offs (each
       gradient hook takes the GIL from another thread; on a 2-core host, 2 ranks: 5-8 %% of a
       step, docs/benchmarks.md).

    Anything else is a ValueError naming the variable."""
    c = choice.strip().lower()
    if c == "thread":
        return True
    if c == "loop":
        return False
    if c in ("", "auto"):
        return cores > local_ranks
    raise ValueError(f"{ENV_BACKWARD}={choice!r}: expected thread, loop or auto")


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _broadcast_groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    return list(by_dtype.values())


async def _broadcast_coalesced(tensors: list[torch.Tensor], src: int, group: ProcessGroup | int | None) -> None:
    """Broadcast ``tensors`` from group rank ``src`` in place: one flat broadcast per dtype,
    issued together, then copied back (torch's ``_broadcast_coalesced``)."""
    pending = []
    for same in _broadcast_groups(tensors):
        flat = torch.cat([t.detach().reshape(-1) for t in same]) if len(same) > 1 else same[0].detach().reshape(-1).clone()
        pending.append((same, flat, broadcast(flat, src, group=group, async_op=True)))
    for same, flat, handle in pending:
        work = await handle
        await work
        off = 0
        with torch.no_grad():
            for t in same:
                n = t.numel()
                t.copy_(flat[off : off + n].view_as(t))
                off += n


def _from_autograd(exc: BaseException) -> bool:
    """Whether ``exc`` was raised outside aiodist (autograd, the user's model or hook): its frames
    say where, so it keeps them."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and not tb.tb_frame.f_code.co_filename.startswith(_AIODIST_DIR)


_AIODIST_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _call_now(callback: Any) -> None:
    callback()


class _Stats:
    """DETAIL's per-iteration times, summed (ns, as torch's logger prints them)."""

    __slots__ = ("n", "forward", "backward", "comm", "overlap")

    def __init__(self) -> None:
        self.n, self.forward, self.backward, self.comm, self.overlap = 0, 0.0, 0.0, 0.0, 0.0

    def add(self, forward: float, backward: float, comm: float, overlap: float) -> None:
        self.n += 1
        self.forward += forward
        self.backward += backward
        self.comm += comm
        self.overlap += overlap

    def averages(self) -> dict[str, int]:
        n = max(self.n, 1)
        return {
            "avg_forward_compute_time": int(self.forward / n * 1e9),
            "avg_backward_compute_time": int(self.backward / n * 1e9),
            "avg_backward_comm_time": int(self.comm / n * 1e9),
            "avg_backward_compute_comm_overlap_time": int(self.overlap / n * 1e9),
        }


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism over an aiodist process group for a CPU ``torch.nn.Module``.

    Construct it and ``await`` it once (``ddp = await DistributedDataParallel(model)``): that
    checks the module on every rank (same parameter names, shapes and dtypes, in the same order)
    and broadcasts rank 0's parameters and buffers. The arguments are torch's; ``device_ids``
    and ``output_device`` are for GPU modules and refused here.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: list[Any] | None = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: ProcessGroup | int | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"DistributedDataParallel wraps a torch.nn.Module, got {type(module).__name__}")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient.")
        devices = {p.device for _, p in module.named_parameters()} | {b.device for b in module.buffers()}
        if device_ids is not None or output_device is not None:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with single-device/multiple-device "
                f"GPU modules, but got device_ids {device_ids}, output_device {output_device}, and module parameters {devices}; "
                "aiodist's DistributedDataParallel takes CPU modules: leave both unset"
            )
        if any(d.type != "cpu" for d in devices):
            raise ValueError(
                f"aiodist's DistributedDataParallel takes CPU modules; this module has parameters or buffers on {sorted(map(str, devices))}"
            )
        if any(p.is_sparse for _, p in named):
            raise ValueError("sparse parameters are not supported by aiodist's DistributedDataParallel")
        self.module = module
        self.dim = dim
        self.broadcast_buffers = bool(broadcast_buffers)
        self.init_sync = bool(init_sync)
        # the group itself, as torch keeps it: after shrink_group of the default group this DDP
        # still names the old one (its later steps fail saying so) until a new DDP takes over
        if process_group is None:
            get_world_size()  # (raises where the default group is not initialised)
            process_group = GroupMember.WORLD
        self.process_group = process_group
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._synced_buffers = [b.data for b in module.buffers()]  # as torch, taken once at construction
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._reducer = Reducer(
            self._params,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            names=self._param_names,
            find_unused_parameters=self.find_unused_parameters,
        )
        self._reducer.direct = not self.gradient_as_bucket_view  # big buckets reduce straight into param.grad
        self.bucket_bytes_cap = self._reducer.limits[-1]
        local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        self._on_thread = backward_on_thread(
            os.environ.get(ENV_BACKWARD, ""),
            _usable_cores(),
            int(local) if local.isdigit() else get_world_size(process_group),  # unknown: every rank may be here
        )
        self._ready = False  # set when the awaited construction finished
        self._retired: str | None = None  # why a newer DDP of the same module took it over
        self._hooks: list[Any] = []
        self._step_sync = False  # did the last forward ask for a synced backward
        self._in_backward = False
        self._backward_calls = 0  # ddp.backward() calls made ...
        self._backward_runs = 0  # ... and awaited to their end
        self._direct_grads = False  # a hook fired outside ddp.backward (loss.backward() called directly)
        self._unused_error: str | None = None
        self._step_task: asyncio.Future[None] | None = None
        self._iteration = 0
        self._stats = _Stats()
        self._forward_s = 0.0

    # -- construction ----------------------------------------------------------------------------

    def __await__(self) -> Any:
        return self._init().__await__()

    async def _init(self) -> DistributedDataParallel:
        if self._ready:
            return self
        await self._verify_model()
        if self.init_sync:
            states = [p.data for p in self.module.parameters()] + [b.data for b in self.module.buffers()]
            with record_comm("ddp init sync"):
                await _broadcast_coalesced(states, 0, self.process_group)
        ref = weakref.ref(self)

        def make_hook(i: int) -> Any:
            def hook(param: torch.Tensor) -> None:
                ddp = ref()
                if ddp is not None:
                    ddp._on_grad(i, param)

            return hook

        self._take_over()
        self._hooks = [p.register_post_accumulate_grad_hook(make_hook(i)) for i, p in enumerate(self._params)]
        self._ready = True
        if get_debug_level() >= DebugLevel.INFO:
            log.info(
                "[Rank %d]: DDP Initialized with: %s",
                get_rank(self.process_group),
                " ".join(f"{k}: {v}" for k, v in sorted(self._logging_data().items())),
            )
        return self

    def _take_over(self) -> None:
        """One DDP serves a module at a time: the last one awaited. An earlier DDP of the same
        module (one whose group was shrunk away, typically) loses its gradient hooks, so they
        cannot fire into its old group, and its later use says why (``_retired``)."""
        old_ref = _SERVING.get(self.module)
        old = old_ref() if old_ref is not None else None
        if old is not None and old is not self:
            old._retire(self)
        _SERVING[self.module] = weakref.ref(self)

    def _retire(self, by: DistributedDataParallel) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._reducer.active:
            self._reducer.abandon()
        pg = self.process_group
        why = getattr(pg, "broken", None) if isinstance(pg, ProcessGroup) else None
        self._retired = (
            "this DistributedDataParallel no longer serves its module: a newer one was made for the same module "
            f"(over {getattr(by.process_group, 'describe', lambda: 'its group')()}); use that one"
            + (f". This one's group ({pg.describe()}) is unusable: {why}" if why and isinstance(pg, ProcessGroup) else "")
        )

    async def _verify_model(self) -> None:
        """Every rank's parameters against rank 0's: names, shapes and dtypes, in order (torch's
        ``_verify_param_shape_across_processes``); the same error on every rank."""
        mine = [(n, tuple(p.shape), str(p.dtype).replace("torch.", "")) for n, p in zip(self._param_names, self._params)]
        everyone: list[Any] = [None] * get_world_size(self.process_group)
        with record_comm("ddp verify model"):
            await all_gather_object(everyone, mine, group=self.process_group)
        ref = everyone[0]
        for rank, theirs in enumerate(everyone):
            if theirs == ref:
                continue
            for k in range(max(len(ref), len(theirs))):
                a = ref[k] if k < len(ref) else None
                b = theirs[k] if k < len(theirs) else None
                if a != b:
                    break
            what = (
                f"rank 0 has {len(ref)} parameters requiring grad and rank {rank} has {len(theirs)}"
                if len(ref) != len(theirs)
                else "the parameter lists differ"
            )

            def show(x: Any) -> str:
                return "nothing" if x is None else f"{x[0]} of shape {list(x[1])} ({x[2]})"

            raise RuntimeError(
                f"DDP expects the same model on every rank, but {what}: parameter {k} is {show(a)} on rank 0 and {show(b)} "
                f"on rank {rank}. Build the same module on every rank (same layers, sizes and dtypes, in the same order)."
            )

    # -- forward -----------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        try:
            self._check_last_step(grad)
        except RuntimeError as exc:  # the sentence says it all: without the frames that found it
            trim_refusal(exc, "DistributedDataParallel.forward")
            raise
        if grad:  # torch: a no_grad forward neither starts nor cancels the expectation of a synced backward
            self._step_sync = self.require_backward_grad_sync
        t0 = time.perf_counter()
        out = self.module(*inputs, **kwargs)
        self._forward_s = time.perf_counter() - t0
        return out

    def _check_last_step(self, grad_enabled: bool = True) -> None:
        if self._retired is not None:
            raise RuntimeError(self._retired)
        if not self._ready:
            raise RuntimeError(
                "DistributedDataParallel(model) was not awaited: write `ddp = await DistributedDataParallel(model)` "
                "(the construction checks the model on every rank and broadcasts rank 0's parameters)"
            )
        self._raise_step_failure()
        if self._backward_calls != self._backward_runs and not self._in_backward:
            self._reset_step()
            raise RuntimeError(
                "ddp.backward(loss) was called but not awaited, so the gradients were not averaged before the next step: "
                "write `await ddp.backward(loss)`"
            )
        if self._direct_grads or self._reducer.active:
            self._reset_step()
            raise RuntimeError(
                "loss.backward() was called directly on a DistributedDataParallel model: its gradient all-reduces were "
                "started but never awaited, so optimizer.step() used gradients that were not averaged. "
                "Write `await ddp.backward(loss)` instead of `loss.backward()`."
            )
        if self._unused_error is not None and grad_enabled:  # torch: raised by a forward that expects a backward
            msg, self._unused_error = self._unused_error, None
            raise RuntimeError(msg)

    def _raise_step_failure(self) -> None:
        """A step still running, or one that failed after the task awaiting it was cancelled."""
        task = self._step_task
        if task is None:
            return
        if not task.done():
            raise RuntimeError(_STILL_RUNNING)
        self._step_task = None
        if not task.cancelled() and task.exception() is not None:
            raise RuntimeError(
                "the previous ddp.backward failed after the task awaiting it was cancelled, so the gradients were not "
                f"averaged: {task.exception()}"
            ) from task.exception()

    def _reset_step(self) -> None:
        self._backward_runs = self._backward_calls
        self._direct_grads = False
        self._step_sync = False
        if self._reducer.active:
            self._reducer.abandon()

    # -- backward ----------------------------------------------------------------------------------

    def backward(
        self, loss: torch.Tensor, gradient: Any = None, retain_graph: bool | None = None, create_graph: bool = False, inputs: Any = None
    ) -> Any:
        """``loss.backward(...)`` with every gradient averaged across the group when awaited
        (``await ddp.backward(loss)``); the arguments are ``Tensor.backward``'s."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"ddp.backward takes the loss tensor, got {type(loss).__name__}")
        self._backward_calls += 1  # counted now: a call never awaited is named at the next forward
        return self._backward(loss, gradient, retain_graph, create_graph, inputs)

    if sys.version_info >= (3, 12):
        backward = inspect.markcoroutinefunction(backward)

    async def _backward(self, loss: torch.Tensor, gradient: Any, retain_graph: bool | None, create_graph: bool, inputs: Any) -> None:
        try:
            await self._backward_checked(loss, gradient, retain_graph, create_graph, inputs)
        except (RuntimeError, ValueError, TypeError) as exc:  # DistError is a RuntimeError
            # the step's error as the awaiting line gets it: one sentence, without aiodist's frames
            # (autograd's own errors keep theirs: they come from the user's model)
            if isinstance(exc, DistError) or not _from_autograd(exc):
                trim_refusal(exc, "DistributedDataParallel.backward")
            raise

    async def _backward_checked(
        self, loss: torch.Tensor, gradient: Any, retain_graph: bool | None, create_graph: bool, inputs: Any
    ) -> None:
        if self._retired is not None:
            self._backward_runs = self._backward_calls
            raise RuntimeError(self._retired)
        try:
            self._raise_step_failure()
        except RuntimeError:
            self._backward_runs = self._backward_calls
            raise
        if self._unused_error is not None:
            self._backward_runs = self._backward_calls
            msg, self._unused_error = self._unused_error, None
            raise RuntimeError(msg)
        # The step belongs to the group, as an op does: cancelling the task that awaits it does
        # not cancel it (its all-reduces must meet the peers'); it runs to its end in its own task.
        task = self._step_task = asyncio.ensure_future(self._step(loss, gradient, retain_graph, create_graph, inputs))
        await asyncio.shield(task)
        self._step_task = None  # awaited to its end: its outcome was this call's

    async def _step(self, loss: torch.Tensor, gradient: Any, retain_graph: bool | None, create_graph: bool, inputs: Any) -> None:
        sync = self._step_sync
        reducer = self._reducer
        self._in_backward = True
        t0 = time.perf_counter()
        try:
            await reducer.settle_late()  # an abandoned step's ops must not write into this step's gradients
            if sync and self.find_unused_parameters:
                reducer.mark_unused(self._unreachable(loss))
            if not self._on_thread:  # on the loop's thread (backward_on_thread): the hooks issue at once
                if sync:
                    reducer.post = _call_now  # a comm hook's error is kept for finish(), as from a thread
                try:
                    loss.backward(gradient, retain_graph, create_graph, inputs)
                finally:
                    reducer.post = None
            else:
                # autograd on a worker thread: the loop stays free, so each bucket's all_reduce moves
                # while backward goes on (and the rank's other tasks run); the hooks hand complete
                # buckets to the loop, which issues them in bucket order
                loop = asyncio.get_running_loop()
                ctx = contextvars.copy_context()
                if sync:
                    reducer.post = lambda callback: loop.call_soon_threadsafe(callback, context=ctx)
                # a Context can be entered by one thread at a time: the backward thread gets its own copy
                run = functools.partial(contextvars.copy_context().run, loss.backward, gradient, retain_graph, create_graph, inputs)
                thread = loop.run_in_executor(None, run)
                try:
                    await asyncio.shield(thread)
                except asyncio.CancelledError:
                    await asyncio.wait([thread])  # autograd cannot be stopped: let it end before the step is given up
                    raise
                finally:
                    reducer.post = None
        except BaseException:
            if reducer.active:
                reducer.abandon()
            self._backward_runs = self._backward_calls
            raise
        finally:
            self._in_backward = False
        t1 = time.perf_counter()
        try:
            if sync:
                missing = await reducer.finish()
                self._write_back()
                if missing and not self.find_unused_parameters:
                    self._unused_error = self._unused_message(missing)
                    log.warning(
                        "rank %d: %d parameter(s) got no gradient this step (%s); the next step raises",
                        get_rank(self.process_group),
                        len(missing),
                        ", ".join(self._param_names[i] for i in missing[:5]),
                    )
            if self.broadcast_buffers and sync:
                await self.sync_buffers()
        finally:
            self._backward_runs = self._backward_calls
            self._direct_grads = False
            self._step_sync = False  # until the next forward: a later local backward is the user's own (torch)
        if sync:
            self._record(t0, t1)

    async def sync_buffers(self) -> None:
        """Broadcast rank 0's buffers to every rank (done after each synced backward when
        ``broadcast_buffers``; call it after forwards that had no backward, if they matter)."""
        buffers = self._synced_buffers
        if buffers:
            with record_comm("ddp buffers"):
                await _broadcast_coalesced(buffers, 0, self.process_group)

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        """A parameter's gradient is final for this backward (autograd's post-accumulate hook)."""
        if not self._step_sync:
            return  # no_sync: accumulate locally
        if not self._in_backward:
            self._direct_grads = True  # loss.backward() called directly: reduce anyway, so peers stay in step
        grad = param.grad
        self._reducer.ready(i, grad)  # a gradient that is its bucket slot already is scaled in place
        if self.gradient_as_bucket_view:
            view = self._reducer.grad_view(i)
            if grad is None or grad.data_ptr() != view.data_ptr():
                param.grad = view  # the fill reads the old tensor, which the bucket holds until then

    def _unreachable(self, loss: torch.Tensor) -> list[int]:
        """Parameters the loss's autograd graph does not reach (torch's search from the outputs)."""
        index = {id(p): i for i, p in enumerate(self._params)}
        seen_nodes: set[int] = set()
        reached: set[int] = set()
        stack: list[Any] = [loss.grad_fn] if loss.grad_fn is not None else []
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen_nodes:
                continue
            seen_nodes.add(id(fn))
            var = getattr(fn, "variable", None)
            if var is not None and id(var) in index:
                reached.add(index[id(var)])
            stack.extend(nxt for nxt, _ in fn.next_functions)
        return [i for i in range(len(self._params)) if i not in reached]

    def _write_back(self) -> None:
        reducer = self._reducer
        unused = reducer.globally_unused if self.find_unused_parameters else set()
        written = reducer.written  # reduced straight into param.grad: nothing to copy
        if not unused and not self.gradient_as_bucket_view:
            if written:
                todo = [i for i in range(len(self._params)) if i not in written]
                grads = [self._params[i].grad for i in todo]
                views = [reducer.grad_view(i) for i in todo]
            else:
                grads, views = [p.grad for p in self._params], reducer.grad_views()
            if not any(g is None for g in grads):  # the common step: one foreach copy (`None in grads` would call Tensor.__eq__)
                if grads:
                    with torch.no_grad():
                        torch._foreach_copy_(cast("list[torch.Tensor]", grads), views)
                return
        copy_to: list[torch.Tensor] = []
        copy_from: list[torch.Tensor] = []
        with torch.no_grad():
            for i, p in enumerate(self._params):
                if i in unused or i in written:
                    continue  # used by no rank: its grad stays as it was (torch); written: it holds the average
                view = reducer.grad_view(i)
                grad = p.grad
                if self.gradient_as_bucket_view:
                    if grad is None or grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif grad is None:
                    p.grad = view.clone()
                else:
                    copy_to.append(grad)
                    copy_from.append(view)
            if copy_to:
                torch._foreach_copy_(copy_to, copy_from)  # one call for every parameter

    def _unused_message(self, missing: list[int]) -> str:
        rank = get_rank(self.process_group)
        names = ", ".join(self._param_names[i] for i in missing)
        indices = ", ".join(str(i) for i in missing)
        return (
            f"{_UNUSED_HINT}\nParameters which did not receive grad for rank {rank}: {names}\n"
            f"Parameter indices which did not receive grad for rank {rank}: {indices}"
        )

    # -- no_sync, hooks, statistics ------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside this block make their backward accumulate gradients locally; the
        first synced backward after it all-reduces the accumulated gradients."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (torch's signature): ``bucket`` is a
        :class:`~aiodist.nn.parallel.reducer.GradBucket` whose buffer holds the undivided
        gradients; the hook returns an awaitable of the reduced buffer (see docs/ddp.md)."""
        if self._backward_calls:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        self._reducer.register_comm_hook(state, hook)

    @property
    def reducer(self) -> Reducer:
        return self._reducer

    def _record(self, t0: float, t1: float) -> None:
        self._iteration += 1
        r = self._reducer
        comm = max(0.0, r.last_done - r.first_issue) if r.first_issue else 0.0
        overlap = max(0.0, min(t1, r.last_done) - r.first_issue) if r.first_issue else 0.0
        self._stats.add(self._forward_s, t1 - t0, comm, overlap)
        n = self._iteration
        if get_debug_level() >= DebugLevel.DETAIL and (n in _STATS_AT or n % 100 == 0):
            a = self._stats.averages()
            log.info(
                "[Rank %d / %d] Training %s unused_parameter_size=%d Avg forward compute time: %d Avg backward compute time: %d "
                "Avg backward comm. time: %d Avg backward comm/comp overlap time: %d",
                get_rank(self.process_group),
                get_world_size(self.process_group),
                type(self.module).__name__,
                sum(self._params[i].numel() * self._params[i].element_size() for i in r.globally_unused),
                a["avg_forward_compute_time"],
                a["avg_backward_compute_time"],
                a["avg_backward_comm_time"],
                a["avg_backward_compute_comm_overlap_time"],
            )

    def _logging_data(self) -> dict[str, Any]:
        r = self._reducer
        return {
            "module_name": type(self.module).__name__,
            "rank": get_rank(self.process_group),
            "world_size": get_world_size(self.process_group),
            "backend_name": str(get_backend(self.process_group)),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "bucket_sizes": ", ".join(map(str, r.bucket_sizes)),
            "num_parameter_tensors": len(self._params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in self._params),
            "dtypes": ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in self._params})),
            "broadcast_buffers": int(self.broadcast_buffers),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "backward_on_thread": int(self._on_thread),
            "has_comm_hook": int(r.has_comm_hook),
            "iteration": self._iteration,
            "device_ids": "",
            "master_addr": os.environ.get("MASTER_ADDR", "N/A"),
            "master_port": os.environ.get("MASTER_PORT", "N/A"),
            "aiodist_debug": str(get_debug_level()).rsplit(".", 1)[-1],
        }

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's ``ddp._get_ddp_logging_data()``: the construction data and the averaged runtime
        statistics (ns)."""
        return {**self._logging_data(), **self._stats.averages()}


DDP = DistributedDataParallel
