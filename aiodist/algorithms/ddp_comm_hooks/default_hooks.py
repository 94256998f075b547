"""The default DDP comm hooks, as torch ships them, written as coroutines.

A hook is ``hook(state, bucket)``: here ``state`` is the process group (None: the default
group) and ``bucket`` a :class:`~aiodist.nn.parallel.reducer.GradBucket` holding the undivided
gradients. Each hook returns a coroutine; DDP runs its first step at once (so its all_reduce
takes its sequence number in bucket order) and awaits the rest after backward. Buffers are
torch tensors (a torch model) or numpy arrays (a ``Reducer`` over numpy parameters); numpy has
no bfloat16, so ``bf16_compress_hook`` takes torch buffers only.

- ``allreduce_hook``: divide by the group size, all-reduce (sum). Same bits as no hook at all
  when the group size is a power of two (a division by it is exact, as the default's
  multiplication by its reciprocal is).
- ``fp16_compress_hook`` / ``bf16_compress_hook``: cast to half precision, divide, all-reduce in
  half precision (half the bytes on the wire), cast back into the bucket.
- ``fp16_compress_wrapper(hook)`` / ``bf16_compress_wrapper(hook)``: run another hook on a
  half-precision copy of the bucket and cast its result back.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aiodist.c10d import all_reduce, get_world_size
from aiodist.types import is_torch_tensor

__all__ = ["allreduce_hook", "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook", "fp16_compress_wrapper"]

Hook = Callable[[Any, Any], Awaitable[Any]]


def _cast(buffer: Any, half: str) -> Any:
    if is_torch_tensor(buffer):
        return buffer.to(getattr(sys.modules["torch"], half))
    if half == "bfloat16":
        raise TypeError("bf16_compress_hook needs torch tensors (numpy has no bfloat16); use fp16_compress_hook for numpy buffers")
    return np.asarray(buffer).astype(np.float16)


def _divide(tensor: Any, n: int) -> Any:
    if is_torch_tensor(tensor):
        return tensor.div_(n)
    np.divide(tensor, n, out=tensor)
    return tensor


def _copy(dst: Any, src: Any) -> None:
    if is_torch_tensor(dst):
        dst.copy_(src)
    else:
        np.copyto(dst, src, casting="unsafe")


async def _allreduce_mean(process_group: Any, tensor: Any) -> Any:
    _divide(tensor, get_world_size(process_group))
    work = await all_reduce(tensor, group=process_group, async_op=True)
    return (await work)[0]


async def allreduce_hook(process_group: Any, bucket: Any) -> Any:
    """Average the bucket: divide by the group size, then all-reduce (sum)."""
    return await _allreduce_mean(process_group, bucket.buffer())


async def _compress(half: str, process_group: Any, bucket: Any) -> Any:
    buffer = bucket.buffer()
    compressed = _divide(_cast(buffer, half), get_world_size(process_group))
    work = await all_reduce(compressed, group=process_group, async_op=True)
    _copy(buffer, (await work)[0])
    return buffer


async def fp16_compress_hook(process_group: Any, bucket: Any) -> Any:
    """Cast the bucket to float16, divide by the group size, all-reduce, cast back."""
    return await _compress("float16", process_group, bucket)


async def bf16_compress_hook(process_group: Any, bucket: Any) -> Any:
    """Cast the bucket to bfloat16 (torch buffers only), divide, all-reduce, cast back."""
    return await _compress("bfloat16", process_group, bucket)


def _wrapper(half: str, hook: Hook) -> Hook:
    async def wrapped(state: Any, bucket: Any) -> Any:
        bucket.set_buffer(_cast(bucket.buffer(), half))  # the hook sees a half-precision bucket
        result = hook(state, bucket)
        while hasattr(result, "__await__"):
            result = await result
        if isinstance(result, (list, tuple)):
            result = result[0]
        return result  # DDP casts it back into the bucket

    wrapped.__name__ = f"{half}_compress_wrapper({getattr(hook, '__name__', 'hook')})"
    return wrapped


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a float16 copy of each bucket and cast its result back
    (``fp16_compress_wrapper(allreduce_hook)`` is ``fp16_compress_hook``)."""
    return _wrapper("float16", hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a bfloat16 copy of each bucket and cast its result back."""
    return _wrapper("bfloat16", hook)
