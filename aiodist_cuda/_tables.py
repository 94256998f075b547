"""NCCL's data types and reduction ops, and the rules mapping aiodist's onto them. Pure: no CuPy.

The numbers are NCCL's enums (``nccl.h``, stable since NCCL 2.0; bfloat16 since 2.10, ncclAvg
since 2.10), so this module needs no CuPy to be imported and tested.

Rules (torch's ProcessGroupNCCL where it has one):
- dtypes: int8, uint8, int32, uint32, int64, uint64, float16, float32, float64, bfloat16 map to
  their NCCL types. bool travels as uint8, with SUM/MAX as MAX (or) and PRODUCT/MIN as MIN (and);
  AVG and PREMUL_SUM on bool are refused. complex64/complex128 travel as pairs of float32/float64:
  SUM and AVG only (elementwise on the parts is the complex result; MIN/MAX/PRODUCT are not).
  int16/uint16 (NCCL has no 16-bit integers) are refused with a TypeError naming the dtype.
- ops: SUM, PRODUCT, MIN, MAX, AVG map to NCCL's; PREMUL_SUM is NCCL's
  ``ncclRedOpCreatePreMulSum`` on floating types only (as torch); BAND/BOR/BXOR are refused: NCCL
  has no bitwise reductions.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiodist.types import ComplexReduceError, ReduceOp, to_reduce_op

__all__ = ["NCCL_DTYPES", "NCCL_OPS", "Wire", "wire_dtype", "nccl_op", "nccl_error_name", "NCCL_FLOATS"]

# ncclDataType_t
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9

# ncclRedOp_t
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

#: element dtype name -> (NCCL type, NCCL elements per array element)
NCCL_DTYPES: dict[str, tuple[int, int]] = {
    "int8": (NCCL_INT8, 1),
    "uint8": (NCCL_UINT8, 1),
    "bool": (NCCL_UINT8, 1),
    "int32": (NCCL_INT32, 1),
    "uint32": (NCCL_UINT32, 1),
    "int64": (NCCL_INT64, 1),
    "uint64": (NCCL_UINT64, 1),
    "float16": (NCCL_FLOAT16, 1),
    "float32": (NCCL_FLOAT32, 1),
    "float64": (NCCL_FLOAT64, 1),
    "bfloat16": (NCCL_BFLOAT16, 1),
    "complex64": (NCCL_FLOAT32, 2),
    "complex128": (NCCL_FLOAT64, 2),
}

#: floating types (PREMUL_SUM's scalar must be one of these, as in torch)
NCCL_FLOATS = frozenset({"float16", "float32", "float64", "bfloat16"})

_R = ReduceOp.RedOpType
NCCL_OPS: dict[_R, int] = {_R.SUM: NCCL_SUM, _R.PRODUCT: NCCL_PROD, _R.MIN: NCCL_MIN, _R.MAX: NCCL_MAX, _R.AVG: NCCL_AVG}

_REFUSED = {"int16": "NCCL has no 16-bit integer type", "uint16": "NCCL has no 16-bit integer type"}


@dataclass(frozen=True, slots=True)
class Wire:
    """How an array goes to NCCL: its NCCL type and how many NCCL elements per array element."""

    nccl: int
    per_element: int


def wire_dtype(name: str, what: str) -> Wire:
    """The NCCL type of dtype ``name``; TypeError naming ``what`` where NCCL has none."""
    got = NCCL_DTYPES.get(name)
    if got is None:
        why = _REFUSED.get(name, "not a dtype NCCL can move")
        known = ", ".join(sorted(NCCL_DTYPES))
        raise TypeError(f"{what} has dtype {name}: {why}; the NCCL backend takes {known}")
    return Wire(*got)


def nccl_op(op: object, dtype: str, what: str) -> tuple[int, float | None]:
    """The NCCL op for ``op`` on ``dtype``: ``(nccl_op, premul_factor)``, the factor set only for
    PREMUL_SUM (the caller makes NCCL's op from it). TypeError for what NCCL cannot do."""
    rop = to_reduce_op(op)
    kind = rop.op
    wire_dtype(dtype, what)  # a dtype NCCL lacks is refused first, whatever the op
    if dtype.startswith("complex") and kind not in (_R.SUM, _R.AVG):  # torch's ValueError, and aiodist's TypeError
        raise ComplexReduceError(
            f"{what.split()[0]} does not support RedOpType.{kind.name} on complex tensors: {what}: ReduceOp.{kind.name} is not "
            f"supported on {dtype} by the NCCL backend (complex: SUM and AVG only)"
        )
    if kind in (_R.BAND, _R.BOR, _R.BXOR):
        raise TypeError(
            f"{what}: ReduceOp.{kind.name} is not supported by the NCCL backend (NCCL has no bitwise reductions); use the CPU backend"
        )
    if dtype == "bool":
        if kind in (_R.SUM, _R.MAX):
            return NCCL_MAX, None
        if kind in (_R.PRODUCT, _R.MIN):
            return NCCL_MIN, None
        raise TypeError(f"{what}: ReduceOp.{kind.name} is not supported on bool tensors by the NCCL backend")
    if kind is _R.PREMUL_SUM:
        if dtype not in NCCL_FLOATS:
            raise TypeError(f"{what}: ReduceOp.PREMUL_SUM needs a floating dtype (float16, float32, float64, bfloat16), not {dtype}")
        assert rop.factor is not None
        return NCCL_SUM, float(rop.factor)
    return NCCL_OPS[kind], None


#: ncclResult_t -> name (CuPy's NcclError knows only 0-5 and fails on the others)
_RESULTS = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
}

_HINTS = {
    1: "a CUDA call inside NCCL failed: check the device, the driver and that the buffers are on the communicator's device",
    2: "a system call failed (sockets, shared memory): check NCCL_SOCKET_IFNAME and the size of /dev/shm; run with NCCL_DEBUG=INFO",
    3: "NCCL hit an internal error or lost a peer; run with NCCL_DEBUG=INFO to see which",
    4: "an argument was invalid: a buffer not on the communicator's device, or a count or root out of range",
    5: "the calls do not match across ranks (order, op, count, root), or two ranks use one GPU (set the device from LOCAL_RANK)",
    6: "a remote rank failed or left the job",
}


def nccl_error_name(status: int) -> str:
    return _RESULTS.get(status, f"ncclResult {status}")


def nccl_hint(status: int) -> str:
    """What to do about NCCL result ``status`` (empty when there is no advice)."""
    return _HINTS.get(status, "")
