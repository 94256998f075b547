"""Reduction ops, the dtype rules, the array adapter and the in-place reductions of the CPU backend.

Pure: numpy only; no asyncio, no sockets, and torch is never imported (a torch tensor is
recognised through ``sys.modules``, so a program that never imported torch never loads it).
``docs/types.md`` has the dtype × op table and the measurements behind it.

Rules this module keeps:

- ``ReduceOp`` is torch's: ``ReduceOp.SUM`` … ``ReduceOp.PREMUL_SUM`` are members of the int enum
  ``ReduceOp.RedOpType`` (so ``ReduceOp.SUM == 0``, as in torch); ``ReduceOp(kind)`` wraps one;
  ``ReduceOp.PREMUL_SUM(factor)`` is a ``ReduceOp`` carrying a factor. Ops compare and hash by
  kind only, as torch's do (``PREMUL_SUM(2.0) == PREMUL_SUM(3.0) == ReduceOp.PREMUL_SUM``), so a
  table keyed by kind finds every op; compare ``.factor`` too where the factor matters.
- A factor is a real number: int, float, numpy real scalar, or a one-element numpy array or torch
  tensor (0-d or any shape). It is read once, when the op is made, and kept as a Python float;
  torch keeps a tensor factor by reference (NCCL reads it when the op runs), so there a later
  change to the tensor changes the op and here it does not. bool and complex factors are refused.
- ``check_reduce(op, dtype)`` holds the dtype rules, in one table: bitwise ops on integers and
  bool only; MIN, MAX and PRODUCT not on complex (torch's list); AVG and PREMUL_SUM on floating
  and complex only. A refusal is a ``TypeError`` naming the op and the dtype; on complex, a
  ``ComplexReduceError`` (ValueError, torch's type, and TypeError) that starts with torch's words.
  Beyond torch's gloo: int16 and uint16/32/64 (gloo: "Invalid scalar type"), PREMUL_SUM (gloo
  refuses it; NCCL has it).
- Reductions run in the array's own dtype and round after every step, as torch's gloo does
  (float16 too: measured, every element of a 3-rank gloo float16 sum is a step-by-step float16
  sum, not a float32 accumulation). Partial results travel between ranks in that dtype, so a
  wider accumulator would only make results depend on the schedule. bfloat16, which numpy lacks,
  is held as its uint16 bits and reduced by widening to float32 and rounding back to nearest-even
  after each step, as torch computes bfloat16 arithmetic. bool: SUM and MAX are or, PRODUCT and
  MIN are and (gloo's results). Integer SUM/PRODUCT wrap around. MIN/MAX propagate NaN.
- Overflow to inf and NaNs are IEEE results, not errors: numpy's floating-point warnings (and an
  ``np.seterr`` that could raise on one rank in the middle of a collective) are off inside these
  functions; torch is silent about them too.
- Every function here is elementwise and deterministic, so a schedule in which each output element
  is computed once, by one rank, and then copied gives bitwise identical results on every rank
  (docs/architecture.md). Recomputing an element elsewhere is safe only in the same argument order:
  ``np.minimum(-0.0, 0.0)`` and ``np.minimum(0.0, -0.0)`` differ, and so does which NaN survives.
- PREMUL_SUM scales each rank's contribution by the factor as it enters (``premultiply``, once, on
  the buffer holding that rank's own data), then sums: prescaling is what keeps a float16 sum from
  overflowing. The factor is first converted to the element type (the parts' type for complex), as
  NCCL does. AVG sums, then ``finalize`` divides once by the world size, as gloo does.
- The adapter (``as_array``) returns a C-contiguous numpy array that shares memory with what it
  was given. An output (``writable=True``) that is not C-contiguous, is read-only, or is a torch
  tensor with its conjugate/negative bit set is refused (``ValueError``); an input that is not
  contiguous is copied once (``Buffer.copied``). A wrong device, dtype, layout or type is a
  ``TypeError``.
"""

from __future__ import annotations

import contextvars
import enum
import numbers
import operator
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import numpy as np

__all__ = [
    "combiner",
    "is_torch_tensor",
    "ReduceOp",
    "RedOpType",
    "ReduceOpLike",
    "reduce_op",
    "to_reduce_op",
    "DTYPES",
    "dtype_name",
    "check_reduce",
    "ComplexReduceError",
    "Buffer",
    "as_array",
    "bfloat16_to_float32",
    "float32_to_bfloat16",
    "premultiply",
    "reduce_into",
    "finalize",
]


# --------------------------------------------------------------------------------------------
# ReduceOp


class ReduceOp:
    """A reduction: one of ``ReduceOp.SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG`` or
    ``ReduceOp.PREMUL_SUM(factor)``.

    The class attributes are ``RedOpType`` members, as in torch; collectives accept those and
    ``ReduceOp`` instances alike. ``ReduceOp(ReduceOp.SUM)`` wraps a kind;
    ``ReduceOp(ReduceOp.PREMUL_SUM, factor)`` is the same as ``ReduceOp.PREMUL_SUM(factor)``.
    """

    class RedOpType(enum.IntEnum):
        """The kinds of reduction, with torch's names and numbers."""

        SUM = 0
        AVG = 1
        PRODUCT = 2
        MIN = 3
        MAX = 4
        BAND = 5
        BOR = 6
        BXOR = 7
        PREMUL_SUM = 8

        def __call__(self, factor: object) -> ReduceOp:
            """``ReduceOp.PREMUL_SUM(factor)``; any other kind refuses a factor, as in torch."""
            if self is not ReduceOp.RedOpType.PREMUL_SUM:
                raise TypeError(f"only ReduceOp.PREMUL_SUM takes a factor; {self}({factor!r}) is not an op")
            return ReduceOp(self, factor)

        # IntEnum prints as a bare number since Python 3.11; error messages want the name.
        def __str__(self) -> str:
            return f"ReduceOp.{self.name}"

        def __repr__(self) -> str:
            return f"ReduceOp.{self.name}"

        def __format__(self, spec: str) -> str:
            return format(str(self), spec)

    SUM: ClassVar[RedOpType] = RedOpType.SUM
    AVG: ClassVar[RedOpType] = RedOpType.AVG
    PRODUCT: ClassVar[RedOpType] = RedOpType.PRODUCT
    MIN: ClassVar[RedOpType] = RedOpType.MIN
    MAX: ClassVar[RedOpType] = RedOpType.MAX
    BAND: ClassVar[RedOpType] = RedOpType.BAND
    BOR: ClassVar[RedOpType] = RedOpType.BOR
    BXOR: ClassVar[RedOpType] = RedOpType.BXOR
    PREMUL_SUM: ClassVar[RedOpType] = RedOpType.PREMUL_SUM

    __slots__ = ("_op", "_factor")
    _op: ReduceOp.RedOpType
    _factor: float | None

    def __init__(self, op: ReduceOp.RedOpType | ReduceOp, factor: object = None) -> None:
        if isinstance(op, ReduceOp):
            if factor is None:
                factor = op._factor
            op = op._op
        if not isinstance(op, ReduceOp.RedOpType):
            raise TypeError(f"ReduceOp() takes a ReduceOp kind such as ReduceOp.SUM, not {type(op).__name__}")
        if op is ReduceOp.RedOpType.PREMUL_SUM:
            if factor is None:
                raise TypeError("ReduceOp.PREMUL_SUM needs a factor: write ReduceOp.PREMUL_SUM(factor)")
            value: float | None = _to_factor(factor)
        elif factor is not None:
            raise TypeError(f"only ReduceOp.PREMUL_SUM takes a factor, not {op}")
        else:
            value = None
        object.__setattr__(self, "_op", op)
        object.__setattr__(self, "_factor", value)

    @property
    def op(self) -> ReduceOp.RedOpType:
        """The kind (``ReduceOp.SUM`` …), as torch's ``ReduceOp.op``."""
        return self._op

    @property
    def name(self) -> str:
        return self._op.name

    @property
    def factor(self) -> float:
        """PREMUL_SUM's factor. Other kinds have none: ``AttributeError`` (torch raises RuntimeError),
        so ``getattr(op, "factor", None)`` works."""
        if self._factor is None:
            raise AttributeError(f"{self._op} has no factor; only ReduceOp.PREMUL_SUM(factor) does")
        return self._factor

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ReduceOp is immutable")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReduceOp):
            return self._op is other._op
        if isinstance(other, ReduceOp.RedOpType):
            return self._op is other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._op)  # equal to its kind, so it must hash like it

    def __repr__(self) -> str:
        if self._factor is not None:
            return f"ReduceOp.PREMUL_SUM({self._factor!r})"
        return f"ReduceOp({self._op})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ReduceOp, (self._op, self._factor))


RedOpType = ReduceOp.RedOpType
ReduceOpLike = ReduceOp | ReduceOp.RedOpType


def is_torch_tensor(obj: object) -> bool:
    """True for a torch tensor; torch is never imported here (only looked up if the caller has)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _to_factor(factor: object) -> float:
    value: object = factor
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(factor, torch.Tensor):
        if factor.numel() != 1 or factor.is_complex() or factor.dtype is torch.bool:
            raise TypeError(f"a PREMUL_SUM factor tensor must hold one real number, not {factor.numel()} of {factor.dtype}")
        value = factor.detach().cpu().reshape(()).item()
    elif isinstance(factor, np.ndarray):
        if factor.size != 1 or factor.dtype.kind not in "iuf":
            raise TypeError(f"a PREMUL_SUM factor array must hold one real number, not {factor.size} of {factor.dtype}")
        value = factor.reshape(()).item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"a PREMUL_SUM factor must be a real number, not {type(factor).__name__} {factor!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError("a PREMUL_SUM factor must fit in a float64") from None


def to_reduce_op(op: object) -> ReduceOp:
    """Normalise what a collective was given as ``op``: a kind, a ``ReduceOp``, or torch's own
    ``ReduceOp``/``RedOpType`` (matched by name, so a script that still passes
    ``torch.distributed.ReduceOp.SUM`` keeps working). ``TypeError`` for anything else."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, ReduceOp.RedOpType):
        return ReduceOp(op)  # PREMUL_SUM without a factor is refused here
    if type(op).__module__.startswith("torch"):
        kind = getattr(op, "op", op)  # torch's ReduceOp wraps a RedOpType in .op
        name = getattr(kind, "name", None)
        if isinstance(name, str) and name in ReduceOp.RedOpType.__members__:
            ours = ReduceOp.RedOpType[name]
            wrapped = kind is not op and ours is ReduceOp.RedOpType.PREMUL_SUM
            return ReduceOp(ours, op.factor if wrapped else None)  # type: ignore[attr-defined]
    raise TypeError(f"op must be a ReduceOp such as ReduceOp.SUM, not {type(op).__name__} {op!r}")


class _DeprecatedReduceOp:
    """``reduce_op``: torch's deprecated alias, kept for old scripts. Every attribute read warns
    (FutureWarning, with torch's wording) and gives the ``ReduceOp`` kind of that name."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if name == "__members__" or name in ReduceOp.RedOpType.__members__:
            warnings.warn("`aiodist.reduce_op` is deprecated, please use `aiodist.ReduceOp` instead", FutureWarning, stacklevel=2)
            return ReduceOp.RedOpType.__members__ if name == "__members__" else ReduceOp.RedOpType[name]
        raise AttributeError(f"reduce_op has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return list(ReduceOp.RedOpType.__members__)

    def __repr__(self) -> str:
        return "<aiodist.reduce_op (deprecated; use aiodist.ReduceOp)>"


reduce_op: Final = _DeprecatedReduceOp()


# --------------------------------------------------------------------------------------------
# dtypes

_BOOL = ("bool",)
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_COMPLEX = ("complex64", "complex128")

DTYPES: Final[tuple[str, ...]] = _BOOL + _INTS + _FLOATS + _COMPLEX
"""Every logical dtype aiodist moves and reduces (numpy names, plus ``"bfloat16"``)."""

_R = ReduceOp.RedOpType
_BITWISE = frozenset(_BOOL + _INTS)
_REAL = frozenset(_BOOL + _INTS + _FLOATS)
_INEXACT = frozenset(_FLOATS + _COMPLEX)

# The dtype rules, in one table: the dtypes each kind of op is defined for, and why not the rest.
_RULES: Final[dict[ReduceOp.RedOpType, tuple[frozenset[str], str]]] = {
    _R.SUM: (frozenset(DTYPES), ""),
    _R.PRODUCT: (_REAL, "torch refuses it on complex tensors (its backends reduce them as pairs of reals)"),
    _R.MIN: (_REAL, "complex numbers have no order"),
    _R.MAX: (_REAL, "complex numbers have no order"),
    _R.BAND: (_BITWISE, "bitwise ops need integer or bool arrays"),
    _R.BOR: (_BITWISE, "bitwise ops need integer or bool arrays"),
    _R.BXOR: (_BITWISE, "bitwise ops need integer or bool arrays"),
    _R.AVG: (_INEXACT, "it needs floating or complex arrays (as in torch); SUM and divide yourself, or convert to float"),
    _R.PREMUL_SUM: (_INEXACT, "it needs floating or complex arrays"),
}

_UFUNCS: Final[dict[ReduceOp.RedOpType, np.ufunc]] = {
    _R.SUM: np.add,  # on bool: logical or, as torch's gloo
    _R.PRODUCT: np.multiply,  # on bool: logical and
    _R.MIN: np.minimum,  # NaN wins, whichever side it is on
    _R.MAX: np.maximum,
    _R.BAND: np.bitwise_and,
    _R.BOR: np.bitwise_or,
    _R.BXOR: np.bitwise_xor,
    _R.AVG: np.add,
    _R.PREMUL_SUM: np.add,
}

_NUMPY_DTYPES: Final[dict[str, np.dtype[Any]]] = {n: np.dtype(n) for n in DTYPES if n != "bfloat16"}
#: native numpy dtypes -> their logical names (dtype_name's fast path)
_NAME_OF_DTYPE: Final[dict[np.dtype[Any], str]] = {d: n for n, d in _NUMPY_DTYPES.items()}
_UNSUPPORTED_HINT = "supported: " + ", ".join(DTYPES)


def dtype_name(dtype: object) -> str:
    """The logical dtype name of a numpy dtype (or type, or name), a torch dtype, or ``"bfloat16"``;
    ``TypeError`` if aiodist does not handle it."""
    if dtype is None:
        raise TypeError("not a dtype: None")
    if type(dtype) is str and dtype in DTYPES:  # the hot path: a logical name already
        return dtype
    if isinstance(dtype, np.dtype):
        cached = _NAME_OF_DTYPE.get(dtype)
        if cached is not None:
            return cached
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        name = dtype.removeprefix("torch.")
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            nd = np.dtype(dtype)  # type: ignore[call-overload]
        except TypeError:
            raise TypeError(f"not a dtype: {dtype!r}") from None
        if nd.name in _NUMPY_DTYPES and not nd.isnative:
            raise TypeError(
                f"dtype {nd.str} is not in native byte order; aiodist works on native arrays: use arr.astype(arr.dtype.newbyteorder('='))"
            )
        name = nd.name if nd.name in _NUMPY_DTYPES else str(nd)
    if name in DTYPES:
        return name
    if name == "object":
        raise TypeError("dtype object is not supported: arrays of Python objects cannot be sent or reduced; use the object collectives")
    raise TypeError(f"dtype {name} is not supported ({_UNSUPPORTED_HINT})")


def _kind(op: object) -> ReduceOp.RedOpType:
    if isinstance(op, ReduceOp.RedOpType):
        return op
    if isinstance(op, ReduceOp):
        return op.op
    return to_reduce_op(op).op


class ComplexReduceError(ValueError, TypeError):
    """A reduce op that complex tensors do not support (MIN, MAX, PRODUCT, the bitwise ops: torch's
    list). torch raises ValueError with the words ``all_reduce does not support RedOpType.MAX on
    complex tensors``; aiodist refused every op/dtype pair with TypeError before, so this is both."""


def check_reduce(op: ReduceOpLike, dtype: object, what: str | None = None) -> None:
    """Refuse, with a ``TypeError`` naming both, an op that is not defined for a dtype; on a
    complex dtype a ``ComplexReduceError`` (ValueError and TypeError) in torch's words, which name
    ``what`` (the collective; "this op" if None).

    ``op`` may be a bare kind (``ReduceOp.PREMUL_SUM`` included: only the kind is checked);
    ``dtype`` is anything ``dtype_name`` takes."""
    kind = _kind(op)
    name = dtype_name(dtype)
    allowed, why = _RULES[kind]
    if name not in allowed:
        if name in _COMPLEX:
            raise ComplexReduceError(
                f"{what or 'this op'} does not support RedOpType.{kind.name} on complex tensors: {kind} is not defined for {name}; {why}"
            )
        raise TypeError(f"{kind} is not defined for {name}; {why}")


# --------------------------------------------------------------------------------------------
# The array adapter


@dataclass(frozen=True, slots=True, eq=False)  # arrays have no single truth value to compare by
class Buffer:
    """An array as the CPU backend sees it.

    ``array`` is a C-contiguous numpy array sharing memory with the object it came from (unless
    ``copied``); for bfloat16 it holds the uint16 bit patterns. ``dtype_name`` is the logical dtype.
    ``source`` is ``"numpy"``, ``"torch"`` or ``"buffer"``."""

    array: np.ndarray[Any, Any]
    dtype_name: str
    source: str
    copied: bool = False

    @property
    def flat(self) -> np.ndarray[Any, Any]:
        """A 1-d view of ``array`` (always a view: ``array`` is contiguous)."""
        return self.array.reshape(-1)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


def as_array(obj: object, *, what: str = "tensor", writable: bool = False) -> Buffer:
    """Take a numpy array, a torch CPU tensor or a buffer-protocol object (bytes, bytearray,
    memoryview, array.array) as a contiguous numpy view. No copy, except of a non-contiguous
    input (``writable=False``), which is copied once.

    ``what`` names the argument in error messages ("all_reduce tensor", "output_tensor_list[2]").
    ``writable=True`` is for outputs, which are written in place: they must be C-contiguous and
    writable (``ValueError`` otherwise). Wrong type, device, layout or dtype: ``TypeError``.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        arr, name, resolved = _torch_view(torch, obj, what, writable)
        if resolved:  # a lazily conjugated/negated input, materialised by torch
            return Buffer(np.ascontiguousarray(arr), name, "torch", copied=True)
        source = "torch"
    elif isinstance(obj, np.ndarray):
        arr = obj.view(np.ndarray) if type(obj) is not np.ndarray else obj  # no subclass semantics
        name = _array_dtype(arr, what)
        source = "numpy"
    else:
        _refuse_foreign(obj, what)
        try:
            view = memoryview(obj)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"{what} must be a numpy array, a torch CPU tensor or a buffer (bytes, bytearray, memoryview, array.array), "
                f"not {type(obj).__module__}.{type(obj).__qualname__}"
            ) from None
        try:
            arr = np.asarray(view)
        except (TypeError, ValueError, NotImplementedError) as exc:
            raise TypeError(f"{what}: a buffer of format {view.format!r} has no numpy dtype ({exc})") from None
        name = _array_dtype(arr, what)
        source = "buffer"
    if writable:
        if not arr.flags.writeable:
            raise ValueError(f"{what} is read-only, but it is an output written in place; pass a writable array")
        if not arr.flags.c_contiguous:
            raise ValueError(
                f"{what} is not contiguous (shape {arr.shape}, strides {arr.strides}), but it is an output written in place; "
                f"call .contiguous() (torch) or np.ascontiguousarray() (numpy) first and copy the result back"
            )
        return Buffer(arr, name, source)
    if not arr.flags.c_contiguous:
        return Buffer(np.ascontiguousarray(arr), name, source, copied=True)
    return Buffer(arr, name, source)


def _array_dtype(arr: np.ndarray[Any, Any], what: str) -> str:
    try:
        return dtype_name(arr.dtype)
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None


def _refuse_foreign(obj: object, what: str) -> None:
    """Arrays in GPU (or other non-host) memory: say where to take them, before the buffer
    protocol is tried (some would copy to the host behind our back)."""
    module = type(obj).__module__.split(".")[0]
    if module == "cupy":
        raise TypeError(f"{what} is a CuPy array (GPU memory); the CPU backend takes numpy arrays; use aiodist_cuda")
    device = getattr(obj, "device", None)
    kind = getattr(device, "type", None)
    if isinstance(kind, str) and kind != "cpu":
        raise TypeError(_device_message(what, device))


def _device_message(what: str, device: object) -> str:
    msg = f"{what} is on {device}; the CPU backend takes CPU tensors"
    if getattr(device, "type", None) == "cuda":
        msg += "; use aiodist_cuda for CUDA tensors"
    return msg


def _torch_view(torch: Any, t: Any, what: str, writable: bool) -> tuple[np.ndarray[Any, Any], str, bool]:
    if t.device.type != "cpu":
        raise TypeError(_device_message(what, t.device))
    if t.layout is not torch.strided or t.is_nested:
        raise TypeError(
            f"{what} is a {'nested' if t.is_nested else str(t.layout)} tensor; the CPU backend takes dense tensors (call .to_dense())"
        )
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"{what}: dtype {t.dtype} is not supported ({_UNSUPPORTED_HINT})")
    t = t.detach()  # shares storage; .numpy() refuses tensors that require grad, torch's c10d does not
    resolved = False
    for flag, fix in (("conj", "resolve_conj"), ("neg", "resolve_neg")):
        if getattr(t, f"is_{flag}")():
            if writable:
                raise ValueError(f"{what} has its lazy {flag} bit set, but it is an output written in place; call .{fix}() first")
            t = getattr(t, fix)()
            resolved = True
    try:
        if name == "bfloat16":
            # numpy has no bfloat16: take the bits. int16 because torch.uint16 is recent (2.3).
            arr = t.view(torch.int16).numpy().view(np.uint16)
        else:
            arr = t.numpy()
    except (RuntimeError, TypeError) as exc:
        raise TypeError(f"{what}: cannot view this tensor as a numpy array ({exc})") from None
    return arr, name, resolved


# --------------------------------------------------------------------------------------------
# bfloat16 <-> float32


def bfloat16_to_float32(bits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """bfloat16 bit patterns (uint16) as float32 values: exact, a new array."""
    wide = bits.astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)


def float32_to_bfloat16(values: np.ndarray[Any, Any], out: np.ndarray[Any, Any] | None = None) -> np.ndarray[Any, Any]:
    """float32 values rounded to bfloat16 (nearest, ties to even; overflow to inf), as uint16 bits.

    A NaN stays a NaN with its sign and the top of its payload, and is made quiet (the bits a
    hardware conversion gives; torch's scalar path gives 0x7FC0 and its vector path 0xFFFF, so
    NaN bits differ between torch's own paths and only NaN-ness can be compared with it)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    r = u >> 16
    r &= 1
    r += 0x7FFF
    r += u  # wraps only for negative NaNs, which are replaced below
    r >>= 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        r[nan] = (u[nan] >> 16) | 0x0040
    if out is None:
        return r.astype(np.uint16)
    np.copyto(out, r, casting="unsafe")
    return out


# --------------------------------------------------------------------------------------------
# Reductions, in place


def _check_pair(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    if dst.dtype != src.dtype:
        raise TypeError(f"cannot reduce {src.dtype} into {dst.dtype}: dtypes must match")
    if dst.shape != src.shape:
        raise ValueError(f"cannot reduce shape {src.shape} into {dst.shape}: shapes must match")


def _logical(arr: np.ndarray[Any, Any], given: str | None) -> str:
    if given is None:
        return arr.dtype.name
    if given == "bfloat16" and arr.dtype != np.uint16:
        raise TypeError(f"bfloat16 data must be held as uint16 bits, not {arr.dtype}")
    return given


def premultiply(array: np.ndarray[Any, Any], op: ReduceOpLike, *, dtype: str | None = None) -> None:
    """PREMUL_SUM's first step: ``array *= factor``, in place, once, on the buffer that holds this
    rank's own contribution (a working copy if the caller's input must stay untouched). A no-op
    for every other op. ``dtype`` is the logical dtype (``"bfloat16"`` for uint16 bits)."""
    rop = to_reduce_op(op)  # a bare ReduceOp.PREMUL_SUM, which has no factor, is refused here
    name = _logical(array, dtype)
    check_reduce(rop, name)
    if rop.op is not ReduceOp.RedOpType.PREMUL_SUM:
        return
    if name == "bfloat16":
        wide = bfloat16_to_float32(array)
        factor = bfloat16_to_float32(float32_to_bfloat16(np.array(rop.factor, dtype=np.float32)))
        with np.errstate(all="ignore"):
            np.multiply(wide, factor, out=wide)
        float32_to_bfloat16(wide, out=array)
        return
    # complex: scale the real and imaginary parts alone; a complex multiply by (f + 0j) would turn
    # inf * 0 into NaN in the other part.
    real = array.view(array.real.dtype) if array.dtype.kind == "c" else array
    with np.errstate(all="ignore"):
        np.multiply(real, real.dtype.type(rop.factor), out=real)


def reduce_into(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], op: ReduceOpLike, *, dtype: str | None = None) -> None:
    """``dst = dst <op> src``, elementwise and in place. ``dst`` and ``src`` have one dtype and
    one shape. For AVG and PREMUL_SUM this is the sum of (already scaled) contributions; see
    ``premultiply`` and ``finalize``. ``dtype`` is the logical dtype (``"bfloat16"`` for uint16 bits)."""
    kind = _kind(op)
    _check_pair(dst, src)
    name = _logical(dst, dtype)
    check_reduce(kind, name)
    ufunc = _UFUNCS[kind]
    with np.errstate(all="ignore"):
        if name == "bfloat16":
            wide = bfloat16_to_float32(dst)
            ufunc(wide, bfloat16_to_float32(src), out=wide)
            float32_to_bfloat16(wide, out=dst)
        else:
            ufunc(dst, src, out=dst)


#: numpy 2 keeps its error state in a context variable (numpy 1: per thread)
_ERRSTATE_IN_CONTEXT = np.lib.NumpyVersion(np.__version__) >= "2.0.0"
_QUIET: list[contextvars.Context] = []  # contexts where numpy ignores floating-point errors, free to enter


def _quiet_context() -> contextvars.Context:
    ctx = contextvars.Context()
    ctx.run(np.errstate(all="ignore").__enter__)  # (never left: the context is this module's own)
    return ctx


def quietly(f: Callable[..., None]) -> Callable[..., None]:
    """``f`` run with numpy's floating-point errors ignored (a reduction's overflow gives inf,
    as torch's does, with no warning). With numpy 2, in a context where ``errstate`` says so,
    made once and reused (one ``Context.run`` per call, where ``errstate`` sets and resets its
    variable per call: a microsecond on a small op); a context is entered by one call at a time,
    so a call takes one from a free list and gives it back (a call in another thread, or nested,
    takes another). With numpy 1, ``errstate``."""
    if not _ERRSTATE_IN_CONTEXT:

        def old(*args: Any) -> None:
            with np.errstate(all="ignore"):
                f(*args)

        return old

    def run(*args: Any) -> None:
        ctx = _QUIET.pop() if _QUIET else _quiet_context()
        try:
            ctx.run(f, *args)
        finally:
            _QUIET.append(ctx)

    return run


_COMBINERS: dict[tuple[ReduceOp.RedOpType, str], Callable[[np.ndarray[Any, Any], np.ndarray[Any, Any]], None]] = {}


def combiner(op: ReduceOpLike, dtype: str, what: str | None = None) -> Callable[[np.ndarray[Any, Any], np.ndarray[Any, Any]], None]:
    """``reduce_into`` for one (op, logical dtype), checked once (``what`` names the collective in
    a refusal): the returned function does only the elementwise work (the collectives call it
    once per received piece). One function per pair, made once and kept."""
    kind = _kind(op)
    name = dtype_name(dtype)
    made = _COMBINERS.get((kind, name))
    if made is not None:
        return made
    check_reduce(kind, name, what)
    made = _make_combiner(kind, name)
    _COMBINERS[(kind, name)] = made
    return made


def _make_combiner(kind: ReduceOp.RedOpType, name: str) -> Callable[[np.ndarray[Any, Any], np.ndarray[Any, Any]], None]:
    if name == "bfloat16":

        def slow(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
            reduce_into(dst, src, kind, dtype=name)

        return slow
    ufunc = _UFUNCS[kind]
    if np.dtype(name).kind in "biu":  # integer and bool ufuncs raise no floating-point warnings

        def exact(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
            if dst.dtype != src.dtype or dst.shape != src.shape:
                _check_pair(dst, src)
            ufunc(dst, src, out=dst)

        return exact

    def floating(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        if dst.dtype != src.dtype or dst.shape != src.shape:
            _check_pair(dst, src)
        ufunc(dst, src, out=dst)

    return quietly(floating)


Fold = Callable[..., None]  # fold(out, parts, tmp=None)
_FOLDS: dict[tuple[ReduceOp.RedOpType, str], Fold] = {}


def folder(op: ReduceOpLike, dtype: str, what: str | None = None) -> Fold:
    """``fold(out, parts, tmp=None)`` for one (op, logical dtype), checked once: ``out`` =
    ``parts[0]`` combined with ``parts[1]``, then the next, in order (``combiner``'s bits, each
    element computed once per part), where ``out`` overlaps no part, or, of two parts, is one
    of them itself (a pair's own slice, not copied first: the same bits; bfloat16's fold, where
    ``out`` is the second, combines through ``tmp`` or a copy to keep the order, which the
    MIN of +0 and -0 or a NaN's payload would show). One call over every part:
    one ufunc call per part after the first and, for floating dtypes, one quiet error state for
    all of them (where ``combiner`` pays both per part). ``tmp`` (out's dtype and size, overlapping
    nothing) lets the steps go from one array to the other: numpy's ufunc writing into one of
    its inputs costs 2-3x one that does not, on a small array. Made once per pair and kept."""
    kind = _kind(op)
    name = dtype_name(dtype)
    made = _FOLDS.get((kind, name))
    if made is not None:
        return made
    combine = combiner(kind, name, what)
    if name == "bfloat16":

        def slow(out: np.ndarray[Any, Any], parts: Sequence[np.ndarray[Any, Any]], tmp: Any = None) -> None:
            if len(parts) == 2 and parts[1] is out:  # a pair's part that is out itself: out = parts[0] (+) out,
                if tmp is None:  # in that order (the MIN of +0 and -0, a NaN's payload show it)
                    first = np.array(parts[0])
                else:
                    first = tmp
                    np.copyto(first, parts[0])
                combine(first, out)
                np.copyto(out, first)
                return
            np.copyto(out, parts[0])
            for p in parts[1:]:
                combine(out, p)

        made = slow
    else:
        ufunc = _UFUNCS[kind]

        def fold(out: np.ndarray[Any, Any], parts: Sequence[np.ndarray[Any, Any]], tmp: Any = None) -> None:
            n = len(parts)
            if n == 2 or tmp is None:
                ufunc(parts[0], parts[1], out=out)
                for p in parts[2:]:
                    ufunc(out, p, out=out)
                return
            # n - 1 steps, the last into out: each step from one array into the other
            a, b = (out, tmp) if n % 2 == 0 else (tmp, out)
            ufunc(parts[0], parts[1], out=a)
            for p in parts[2:]:
                ufunc(a, p, out=b)
                a, b = b, a

        made = fold if np.dtype(name).kind in "biu" else quietly(fold)  # integer and bool ufuncs raise no floating-point warnings
    _FOLDS[(kind, name)] = made
    return made


def finalize(dst: np.ndarray[Any, Any], op: ReduceOpLike, world_size: int, *, dtype: str | None = None) -> None:
    """The last step, once, on the fully reduced result: AVG divides by ``world_size`` (the sum is
    divided once, in float32 for float16 and bfloat16, then rounded once; complex parts are divided
    separately). A no-op for every other op, and for AVG over one rank."""
    kind = _kind(op)
    try:
        n = operator.index(world_size)
    except TypeError:
        raise TypeError(f"world_size must be an int, not {type(world_size).__name__}") from None
    if isinstance(world_size, bool) or n < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    name = _logical(dst, dtype)
    check_reduce(kind, name)
    if kind is not ReduceOp.RedOpType.AVG or n == 1:
        return
    with np.errstate(all="ignore"):
        if name == "bfloat16":
            wide = bfloat16_to_float32(dst)
            np.divide(wide, np.float32(n), out=wide)
            float32_to_bfloat16(wide, out=dst)
        elif name == "float16":
            # world sizes above 2048 are not all float16 numbers; float32 holds them exactly, and one
            # rounding of the float32 quotient to float16 is the correctly rounded float16 quotient.
            np.divide(dst, np.float32(n), out=dst, dtype=np.float32)
        else:
            real = dst.view(dst.real.dtype) if dst.dtype.kind == "c" else dst
            np.divide(real, real.dtype.type(n), out=real)
