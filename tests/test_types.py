"""aiodist.types (tier 1, pure): ReduceOp and reduce_op, the dtype × op rules, the array adapter
(numpy, torch CPU tensors, buffers), the in-place reductions against an independent reference,
and bfloat16 rounding against a scalar reference and against torch."""

from __future__ import annotations

import array
import ast
import math
import pathlib
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import aiodist
from aiodist import types as T
from aiodist.types import (
    DTYPES,
    Buffer,
    ReduceOp,
    as_array,
    bfloat16_to_float32,
    check_reduce,
    combiner,
    dtype_name,
    finalize,
    float32_to_bfloat16,
    folder,
    premultiply,
    reduce_into,
    reduce_op,
)

R = ReduceOp.RedOpType
OPS = list(R)

# -- the expected rules, written out independently of aiodist.types._RULES ---------------------

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]
ALL = ["bool", *INTS, *FLOATS, *COMPLEX]

Y, N = True, False
#            SUM PRODUCT MIN MAX BAND BOR BXOR AVG PREMUL_SUM
ROW_BOOL = (Y, Y, Y, Y, Y, Y, Y, N, N)
ROW_INT = (Y, Y, Y, Y, Y, Y, Y, N, N)
ROW_FLOAT = (Y, Y, Y, Y, N, N, N, Y, Y)
ROW_COMPLEX = (Y, N, N, N, N, N, N, Y, Y)  # PRODUCT: refused, as torch refuses it
COLUMNS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR, R.AVG, R.PREMUL_SUM]
EXPECTED: dict[tuple[str, R], bool] = {}
for _names, _row in (((["bool"]), ROW_BOOL), (INTS, ROW_INT), (FLOATS, ROW_FLOAT), (COMPLEX, ROW_COMPLEX)):
    for _n in _names:
        for _op, _ok in zip(COLUMNS, _row):
            EXPECTED[(_n, _op)] = _ok


def test_the_dtype_list() -> None:
    assert sorted(DTYPES) == sorted(ALL)
    assert len(EXPECTED) == len(ALL) * 9


# -- a scalar reference: exact arithmetic in Python, then rounding to the format ----------------

# (significant bits, exponent of the smallest normal, largest finite)
FORMATS: dict[str, tuple[int, int, float]] = {
    "float16": (11, -14, 65504.0),
    "bfloat16": (8, -126, (2 - 2**-7) * 2.0**127),
    "float32": (24, -126, (2 - 2**-23) * 2.0**127),
}


def round_to(x: float, fmt: str) -> float:
    """x rounded to nearest, ties to even, in a binary format (with subnormals and overflow)."""
    if fmt == "float64" or x == 0 or not math.isfinite(x):
        return x
    p, emin, top = FORMATS[fmt]
    _, e = math.frexp(x)
    quantum = max(e - p, emin - p + 1)
    y = math.ldexp(round(math.ldexp(x, -quantum)), quantum)  # round() is ties-to-even
    y = math.copysign(y, x)
    return y if abs(y) <= top else math.copysign(math.inf, x)


def part_format(name: str) -> str:
    return {"complex64": "float32", "complex128": "float64"}.get(name, name)


def round_value(x: Any, name: str) -> Any:
    if name == "bool":
        return bool(x)
    if name in INTS:
        info = np.iinfo(name)
        span = 1 << info.bits
        v = int(x) % span
        return v - span if v > info.max else v
    if name in COMPLEX:
        f = part_format(name)
        return complex(round_to(x.real, f), round_to(x.imag, f))
    if name == "bfloat16":  # computed in float32, then rounded again (as aiodist and torch do)
        return round_to(round_to(float(x), "float32"), "bfloat16")
    return round_to(float(x), name)


def step(op: R, a: Any, b: Any, name: str) -> Any:
    if name == "bool":
        table = {R.SUM: a or b, R.PRODUCT: a and b, R.MIN: a and b, R.MAX: a or b, R.BAND: a and b, R.BOR: a or b, R.BXOR: a != b}
        return table[op]
    if op in (R.SUM, R.AVG, R.PREMUL_SUM):
        return a + b
    if op == R.PRODUCT:
        return a * b
    if op == R.MIN:
        return min(a, b)
    if op == R.MAX:
        return max(a, b)
    return {R.BAND: a & b, R.BOR: a | b, R.BXOR: a ^ b}[op]


def reference(op: R, columns: list[list[Any]], name: str, factor: float | None = None) -> list[Any]:
    """Rank 0's contribution first, then each next rank's, rounded after every step."""
    n = len(columns)
    out = []
    for values in zip(*columns):
        vals = list(values)
        if op == R.PREMUL_SUM:
            assert factor is not None
            f = round_to(round_to(factor, "float32"), "bfloat16") if name == "bfloat16" else round_to(factor, part_format(name))
            vals = [round_value(v * f, name) for v in vals]
        acc = vals[0]
        for v in vals[1:]:
            acc = round_value(step(op, acc, v, name), name)
        if op == R.AVG:
            acc = round_value(acc / n, name)
        out.append(acc)
    return out


def to_storage(values: list[Any], name: str) -> np.ndarray:
    """Python values -> the array aiodist holds (bfloat16: the bits, cut from exact float32s)."""
    if name == "bfloat16":
        f = np.array(values, dtype=np.float32)
        assert all(round_to(float(v), "bfloat16") == float(v) for v in f)
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    return np.array(values, dtype=name)


def from_storage(arr: np.ndarray, name: str) -> list[Any]:
    if name == "bfloat16":
        return [float(v) for v in (arr.astype(np.uint32) << 16).view(np.float32)]
    return arr.tolist()


def sample(rng: np.random.Generator, name: str, size: int) -> list[Any]:
    """Values whose every intermediate is exact in float64, so the reference's one rounding per
    step is the only rounding; complex values are small enough that complex64 products are exact."""
    if name == "bool":
        return (rng.random(size) < 0.5).tolist()
    if name in INTS:
        info = np.iinfo(name)
        return [int(v) for v in rng.integers(info.min, info.max, size=size, endpoint=True, dtype=name)]
    if name in COMPLEX:
        return [complex(a, b) for a, b in zip(rng.integers(-4, 5, size) / 2, rng.integers(-4, 5, size) / 2)]
    return (rng.integers(-32, 33, size) / 4).tolist()


def sample_full(rng: np.random.Generator, name: str, size: int) -> list[Any]:
    """Floating values with every bit of their type's precision in use (for products that round)."""

    def one() -> float:
        return float(round_value(float(rng.standard_normal() * 2.0 ** rng.integers(-8, 9)), part_format(name)))

    if name in COMPLEX:
        return [complex(one(), one()) for _ in range(size)]
    return [one() for _ in range(size)]


def run_reduction(op: ReduceOp | R, contributions: list[np.ndarray], name: str) -> np.ndarray:
    """What a schedule does for each element: scale every contribution once as it enters, fold
    them in rank order, finish once."""
    acc = contributions[0].copy()
    premultiply(acc, op, dtype=name)
    for c in contributions[1:]:
        incoming = c.copy()
        premultiply(incoming, op, dtype=name)
        reduce_into(acc, incoming, op, dtype=name)
    finalize(acc, op, len(contributions), dtype=name)
    return acc


def same(got: list[Any], want: list[Any], op: R) -> bool:
    """Equal values; for everything but MIN/MAX (where IEEE leaves min(-0.0, 0.0) open) equal signs of zero too."""
    if got != want:
        return False
    if op in (R.MIN, R.MAX):
        return True
    for g, w in zip(got, want):
        parts = [(g.real, w.real), (g.imag, w.imag)] if isinstance(g, complex) else [(g, w)]
        if any(isinstance(a, float) and math.copysign(1, a) != math.copysign(1, b) for a, b in parts):
            return False
    return True


# -- every dtype × op pair ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("op", COLUMNS, ids=lambda o: o.name)
def test_every_dtype_op_pair(name: str, op: R) -> None:
    rng = np.random.default_rng([ALL.index(name), int(op)])
    if not EXPECTED[(name, op)]:
        for call in (
            lambda: check_reduce(op, name),
            lambda: reduce_into(to_storage(sample(rng, name, 4), name), to_storage(sample(rng, name, 4), name), op, dtype=name),
            lambda: finalize(to_storage(sample(rng, name, 4), name), op, 2, dtype=name),
        ):
            with pytest.raises(TypeError) as exc:
                call()
            assert f"ReduceOp.{op.name}" in str(exc.value) and name in str(exc.value)
        return
    check_reduce(op, name)
    the_op: ReduceOp | R = op(0.375) if op == R.PREMUL_SUM else op
    for world in (2, 3, 4, 5):
        columns = [sample(rng, name, 64) for _ in range(world)]
        got = from_storage(run_reduction(the_op, [to_storage(c, name) for c in columns], name), name)
        want = reference(op, columns, name, 0.375)
        assert same(got, want, op), f"{op} on {name} over {world} ranks:\n got {got}\nwant {want}"


@pytest.mark.parametrize("name", FLOATS + COMPLEX)
@pytest.mark.parametrize("factor", [0.5, 1 / 3, -2.5, 3, np.float64(0.1), np.array(1.75), np.array([-0.2])])
def test_premul_sum_factors(name: str, factor: Any) -> None:
    rng = np.random.default_rng(7)
    op = ReduceOp.PREMUL_SUM(factor)
    f = float(np.asarray(factor).reshape(()))
    assert op.factor == f
    for columns in ([sample(rng, name, 32) for _ in range(3)], [sample_full(rng, name, 256) for _ in range(4)]):
        got = from_storage(run_reduction(op, [to_storage(c, name) for c in columns], name), name)
        assert same(got, reference(R.PREMUL_SUM, columns, name, f), R.PREMUL_SUM)


def test_premul_sum_scales_before_summing() -> None:
    # float16 overflows if the sum comes first: 3 × 32000 > 65504, but 3 × 32000 / 4 does not.
    xs = [np.full(4, 32000, np.float16) for _ in range(3)]
    out = run_reduction(ReduceOp.PREMUL_SUM(0.25), xs, "float16")
    assert out.tolist() == [24000.0] * 4
    assert np.isinf(run_reduction(R.SUM, xs, "float16")).all()


def test_integers_wrap_and_bool_is_logical() -> None:
    a, b = np.array([100, -128, 7], np.int8), np.array([100, -1, 3], np.int8)
    reduce_into(a, b, R.SUM)
    assert a.tolist() == [-56, 127, 10]
    u = np.array([16, 255], np.uint8)
    reduce_into(u, np.array([16, 2], np.uint8), R.PRODUCT)
    assert u.tolist() == [0, 254]
    # what torch's gloo gives for bool (measured with two ranks): SUM is or, PRODUCT and MIN are and.
    x, y = [True, False, True, True], [True, False, False, True]
    gloo = {R.SUM: [1, 0, 1, 1], R.PRODUCT: [1, 0, 0, 1], R.MIN: [1, 0, 0, 1], R.MAX: [1, 0, 1, 1],
            R.BAND: [1, 0, 0, 1], R.BOR: [1, 0, 1, 1], R.BXOR: [0, 0, 1, 0]}  # fmt: skip
    for op, want in gloo.items():
        acc = np.array(x)
        reduce_into(acc, np.array(y), op)
        assert acc.tolist() == [bool(w) for w in want], op


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_min_max_propagate_nan(name: str) -> None:
    nan_first = to_storage([math.nan, 1.0], name) if name != "bfloat16" else np.array([0x7FC0, 0x3F80], np.uint16)
    plain = to_storage([2.0, 2.0], name)
    for op in (R.MIN, R.MAX):
        for dst, src in ((nan_first.copy(), plain.copy()), (plain.copy(), nan_first.copy())):
            reduce_into(dst, src, op, dtype=name)
            vals = from_storage(dst, name)
            assert math.isnan(vals[0]) and vals[1] == (1.0 if op == R.MIN else 2.0), (op, name, vals)


def test_avg() -> None:
    a = np.array([1.0, 2.0, -3.0], np.float32)
    finalize(a, R.AVG, 4)
    assert a.tolist() == [0.25, 0.5, -0.75]
    # one rank: untouched (not even a NaN's payload changes)
    b = np.array([0x7F81, 0x3F80], np.uint16)
    finalize(b, R.AVG, 1, dtype="bfloat16")
    assert b.tolist() == [0x7F81, 0x3F80]
    # a world size float16 cannot hold exactly (3001 -> 3000 in float16): the quotient is still right
    h = np.array([6000.0, 1.0], np.float16)
    finalize(h, R.AVG, 3001)
    assert h.tolist() == [round_to(6000 / 3001, "float16"), round_to(1 / 3001, "float16")]
    # complex parts are divided separately: inf stays inf, the other part is not turned into NaN
    c = np.array([complex(math.inf, 1.0)], np.complex64)
    finalize(c, R.AVG, 2)
    assert c[0].real == math.inf and c[0].imag == 0.5
    p = np.array([complex(math.inf, 1.0)], np.complex128)
    premultiply(p, ReduceOp.PREMUL_SUM(0.5))
    assert p[0].real == math.inf and p[0].imag == 0.5
    for other in (R.SUM, R.MAX, ReduceOp.PREMUL_SUM(2.0)):
        d = np.array([3.0, 5.0])
        finalize(d, other, 2)
        assert d.tolist() == [3.0, 5.0]
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="world_size"):
            finalize(np.ones(2), R.AVG, bad)
    with pytest.raises(TypeError, match="world_size"):
        finalize(np.ones(2), R.AVG, 2.0)  # type: ignore[arg-type]
    finalize(a, R.AVG, np.int64(2))  # numpy ints are ints


def test_reduction_argument_errors() -> None:
    with pytest.raises(TypeError, match="dtypes must match"):
        reduce_into(np.ones(3, np.float32), np.ones(3, np.float64), R.SUM)
    with pytest.raises(ValueError, match="shapes must match"):
        reduce_into(np.ones(3), np.ones(4), R.SUM)
    with pytest.raises(TypeError, match="uint16 bits"):
        reduce_into(np.ones(3, np.float32), np.ones(3, np.float32), R.SUM, dtype="bfloat16")
    with pytest.raises(TypeError, match="needs a factor"):
        premultiply(np.ones(3), R.PREMUL_SUM)
    with pytest.raises(TypeError, match="not defined for int32"):
        premultiply(np.ones(3, np.int32), ReduceOp.PREMUL_SUM(2))
    with pytest.raises(TypeError, match="op must be a ReduceOp"):
        reduce_into(np.ones(3), np.ones(3), "sum")  # type: ignore[arg-type]
    x = np.ones(3)
    premultiply(x, R.SUM)  # a no-op for every op but PREMUL_SUM
    assert x.tolist() == [1.0, 1.0, 1.0]
    empty = np.ones(0, np.float16)
    reduce_into(empty, empty.copy(), R.SUM)
    finalize(empty, R.AVG, 3)


# -- check_reduce and dtype names ---------------------------------------------------------------


def test_check_reduce_messages() -> None:
    with pytest.raises(TypeError) as exc:
        check_reduce(ReduceOp.BAND, np.float32)
    assert str(exc.value) == "ReduceOp.BAND is not defined for float32; bitwise ops need integer or bool arrays"
    with pytest.raises(TypeError, match=r"ReduceOp\.MAX is not defined for complex128; complex numbers have no order"):
        check_reduce(ReduceOp.MAX, "complex128")
    with pytest.raises(TypeError, match=r"ReduceOp\.AVG is not defined for int64; .*floating or complex"):
        check_reduce(ReduceOp(ReduceOp.AVG), np.dtype("int64"))
    with pytest.raises(TypeError, match=r"ReduceOp\.PREMUL_SUM is not defined for bool"):
        check_reduce(ReduceOp.PREMUL_SUM(2.0), bool)
    check_reduce(ReduceOp.PREMUL_SUM, "bfloat16")  # a bare kind is enough to check a dtype


def test_dtype_name() -> None:
    assert dtype_name(np.float32) == "float32"
    assert dtype_name(np.dtype("<i2")) == "int16"
    assert dtype_name("bfloat16") == "bfloat16"
    assert dtype_name("torch.bfloat16") == "bfloat16"
    assert dtype_name("f8") == "float64"
    assert dtype_name(bool) == "bool"
    for bad, words in ((None, "not a dtype"), (object, "dtype object"), ("float128", "not supported"), ("M8[ns]", "datetime64"),
                       (np.dtype(">f4"), "byte order"), ("U3", "not supported"), ("nonsense", "not a dtype")):  # fmt: skip
        with pytest.raises(TypeError, match=words):
            dtype_name(bad)


# -- ReduceOp and reduce_op ---------------------------------------------------------------------


def test_reduce_op_kinds() -> None:
    assert [(k.name, int(k)) for k in R] == [
        ("SUM", 0), ("AVG", 1), ("PRODUCT", 2), ("MIN", 3), ("MAX", 4), ("BAND", 5), ("BOR", 6), ("BXOR", 7), ("PREMUL_SUM", 8)
    ]  # fmt: skip
    assert T.RedOpType is ReduceOp.RedOpType and ReduceOp.RedOpType.__qualname__ == "ReduceOp.RedOpType"
    for k in R:
        assert getattr(ReduceOp, k.name) is k
    assert ReduceOp.SUM == ReduceOp.SUM and ReduceOp.SUM != ReduceOp.MAX and ReduceOp.SUM == 0
    assert str(ReduceOp.BAND) == repr(ReduceOp.BAND) == f"{ReduceOp.BAND}" == "ReduceOp.BAND"
    assert aiodist.ReduceOp is ReduceOp and "ReduceOp" in aiodist.__all__ and "reduce_op" in aiodist.__all__


def test_reduce_op_instances() -> None:
    s = ReduceOp(ReduceOp.SUM)
    assert s == ReduceOp.SUM and ReduceOp.SUM == s and s != ReduceOp.MAX and s.op is R.SUM and s.name == "SUM"
    assert {ReduceOp.SUM: "sum", ReduceOp.MAX: "max"}[s] == "sum"
    assert {s: 1}[ReduceOp.SUM] == 1 and ReduceOp(s) == s
    assert repr(s) == "ReduceOp(ReduceOp.SUM)"
    p = ReduceOp.PREMUL_SUM(0.5)
    assert isinstance(p, ReduceOp) and p.op is R.PREMUL_SUM and p.factor == 0.5 and repr(p) == "ReduceOp.PREMUL_SUM(0.5)"
    # compared by kind, as torch does; the factor is compared separately where it matters
    assert p == ReduceOp.PREMUL_SUM == ReduceOp.PREMUL_SUM(2.0) and hash(p) == hash(ReduceOp.PREMUL_SUM)
    assert ReduceOp(ReduceOp.PREMUL_SUM, 2) == p and ReduceOp(ReduceOp.PREMUL_SUM, 2).factor == 2.0
    assert ReduceOp(p).factor == 0.5
    for x in (s, p, ReduceOp.MIN):
        y = pickle.loads(pickle.dumps(x))
        assert y == x and getattr(y, "factor", None) == getattr(x, "factor", None)
    assert pickle.loads(pickle.dumps(ReduceOp.MIN)) is ReduceOp.MIN
    with pytest.raises(AttributeError, match="no factor"):
        _ = s.factor
    assert getattr(s, "factor", None) is None
    with pytest.raises(AttributeError):
        s._op = R.MAX  # type: ignore[misc]


def test_premul_sum_factor_forms() -> None:
    assert ReduceOp.PREMUL_SUM(3).factor == 3.0 and isinstance(ReduceOp.PREMUL_SUM(3).factor, float)
    assert ReduceOp.PREMUL_SUM(np.float32(0.5)).factor == 0.5
    assert ReduceOp.PREMUL_SUM(np.array(0.25)).factor == 0.25  # 0-d
    assert ReduceOp.PREMUL_SUM(np.array([[4]], np.int16)).factor == 4.0  # one element, any shape
    arr = np.array(2.0)
    op = ReduceOp.PREMUL_SUM(arr)
    arr[()] = 5.0
    assert op.factor == 2.0  # read when the op is made
    for bad, err in ((True, TypeError), (1j, TypeError), ("2", TypeError), (np.ones(2), TypeError), (np.array(True), TypeError),
                     (np.array(1j), TypeError), (None, TypeError), (10**400, ValueError)):  # fmt: skip
        with pytest.raises(err):
            ReduceOp.PREMUL_SUM(bad)
    with pytest.raises(TypeError, match="only ReduceOp.PREMUL_SUM takes a factor"):
        ReduceOp.SUM(2.0)
    with pytest.raises(TypeError, match="only ReduceOp.PREMUL_SUM takes a factor"):
        ReduceOp(ReduceOp.MAX, 2.0)
    with pytest.raises(TypeError, match="needs a factor"):
        ReduceOp(ReduceOp.PREMUL_SUM)
    with pytest.raises(TypeError, match="ReduceOp kind"):
        ReduceOp(0)  # type: ignore[arg-type]


def test_to_reduce_op() -> None:
    assert T.to_reduce_op(ReduceOp.MAX) == ReduceOp.MAX and isinstance(T.to_reduce_op(ReduceOp.MAX), ReduceOp)
    p = ReduceOp.PREMUL_SUM(2.0)
    assert T.to_reduce_op(p) is p
    for bad in (ReduceOp.PREMUL_SUM, "SUM", 0, None):
        with pytest.raises(TypeError):
            T.to_reduce_op(bad)


def test_reduce_op_alias_warns_like_torch() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [reduce_op.SUM, reduce_op.PRODUCT, reduce_op.MIN, reduce_op.MAX]
    assert got == [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    assert got[0] is ReduceOp.SUM
    assert [w.category for w in caught] == [FutureWarning] * 4
    assert "deprecated" in str(caught[0].message) and "ReduceOp" in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller
    with pytest.warns(FutureWarning):
        assert reduce_op.BAND is ReduceOp.BAND  # torch's alias has every kind
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            _ = reduce_op.NOPE
    assert aiodist.reduce_op is reduce_op


@pytest.mark.torch
def test_kinds_and_alias_match_torch() -> None:
    dist = pytest.importorskip("torch.distributed")
    assert {k: int(v) for k, v in dist.ReduceOp.RedOpType.__members__.items()} == {k.name: int(k) for k in R}
    with pytest.warns(FutureWarning):
        assert int(dist.reduce_op.SUM) == int(reduce_op.SUM)
    # a script that still passes torch's ops keeps working
    assert T.to_reduce_op(dist.ReduceOp.MAX) == ReduceOp.MAX
    assert T.to_reduce_op(dist.ReduceOp(dist.ReduceOp.BOR)) == ReduceOp.BOR
    p = T.to_reduce_op(dist.ReduceOp.PREMUL_SUM(0.25))
    assert p == ReduceOp.PREMUL_SUM and p.factor == 0.25
    torch = pytest.importorskip("torch")
    assert ReduceOp.PREMUL_SUM(torch.tensor(1.5)).factor == 1.5
    assert ReduceOp.PREMUL_SUM(torch.tensor([3])).factor == 3.0
    with pytest.raises(TypeError):
        ReduceOp.PREMUL_SUM(torch.ones(2))


# -- the array adapter --------------------------------------------------------------------------


def test_numpy_arrays_are_views() -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = as_array(a, writable=True)
    assert isinstance(b, Buffer) and b.array is a and b.dtype_name == "int32" and b.source == "numpy" and not b.copied
    assert b.shape == (2, 3) and b.nbytes == 24 and np.shares_memory(b.flat, a)
    b.flat[4] = 40
    assert a[1, 1] == 40
    m = np.ma.masked_array([1.0, 2.0])
    assert type(as_array(m).array) is np.ndarray  # no subclass behaviour in the ufuncs
    for empty in (np.zeros(0, np.float32), np.zeros((3, 0)), np.array(5.0)):
        assert as_array(empty, writable=True).array.shape == empty.shape


def test_outputs_must_be_contiguous_and_writable() -> None:
    a = np.arange(12.0).reshape(3, 4)
    with pytest.raises(ValueError, match=r"all_reduce tensor is not contiguous.*\.contiguous\(\).*np\.ascontiguousarray"):
        as_array(a.T, what="all_reduce tensor", writable=True)
    with pytest.raises(ValueError, match="not contiguous"):
        as_array(a[:, ::2], writable=True)
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="output_tensor is read-only"):
        as_array(ro, what="output_tensor", writable=True)
    # inputs: read-only is fine, and a non-contiguous one is copied once
    assert as_array(ro).array is ro
    b = as_array(a.T)
    assert b.copied and b.array.flags.c_contiguous and np.array_equal(b.array, a.T) and not np.shares_memory(b.array, a)


def test_buffer_protocol_objects() -> None:
    b = as_array(b"\x01\x02")
    assert b.dtype_name == "uint8" and b.array.tolist() == [1, 2] and b.source == "buffer"
    with pytest.raises(ValueError, match="read-only"):
        as_array(b"\x01\x02", writable=True)
    ba = bytearray(4)
    as_array(ba, writable=True).array[:] = [9, 8, 7, 6]
    assert ba == bytearray([9, 8, 7, 6])
    arr = array.array("d", [1.0, 2.0])
    buf = as_array(arr, writable=True)
    assert buf.dtype_name == "float64"
    reduce_into(buf.array, np.array([0.5, 0.5]), R.SUM)
    assert arr.tolist() == [1.5, 2.5]
    mv = memoryview(bytearray(8)).cast("i")
    assert as_array(mv).dtype_name == "int32" and as_array(mv).array.shape == (2,)
    with pytest.raises(ValueError, match="not contiguous"):
        as_array(memoryview(bytearray(8))[::2], writable=True)
    with pytest.raises(TypeError, match="not supported"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 'u' is deprecated from 3.13: the format is what is tested
        as_array(array.array("u", "ab"))


def test_refusals_name_what_is_wrong() -> None:
    for bad, words in (
        ([1, 2], "must be a numpy array, a torch CPU tensor or a buffer.*builtins.list"),
        (3.0, "builtins.float"),
        (np.array([object()]), "dtype object"),
        (np.zeros(2, ">f4"), "byte order"),
        (np.zeros(2, "M8[s]"), "datetime64"),
        (np.zeros(2, np.clongdouble), "not supported"),
    ):
        with pytest.raises(TypeError, match=words):
            as_array(bad, what="x")


class _Device:
    def __init__(self, kind: str, index: int) -> None:
        self.type, self.index = kind, index

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


class _FakeGpuArray:
    """Stands in for an accelerator array that also exposes the buffer protocol (host staging)."""

    def __init__(self, kind: str) -> None:
        self.device = _Device(kind, 0)
        self._host = bytearray(8)

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self._host)


def test_device_arrays_are_refused() -> None:
    with pytest.raises(TypeError, match=r"all_reduce tensor is on cuda:0; the CPU backend takes CPU tensors; use aiodist_cuda"):
        as_array(_FakeGpuArray("cuda"), what="all_reduce tensor")
    with pytest.raises(TypeError, match="is on xpu:0") as exc:
        as_array(_FakeGpuArray("xpu"))
    assert "aiodist_cuda" not in str(exc.value)


# -- torch tensors ------------------------------------------------------------------------------

TORCH_DTYPES = ALL


@pytest.mark.torch
@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_torch_tensors_are_updated_in_place(name: str) -> None:
    torch = pytest.importorskip("torch")
    dt = getattr(torch, name)
    rng = np.random.default_rng(ALL.index(name))
    if name == "bool":
        x, y = torch.from_numpy(rng.random(9) < 0.5), torch.from_numpy(rng.random(9) < 0.5)
    elif name in INTS:
        x = torch.from_numpy(rng.integers(0, 50, 9).astype(name))
        y = torch.from_numpy(rng.integers(0, 50, 9).astype(name))
    else:
        x = (torch.from_numpy(rng.standard_normal(9)) * 100).to(dt)
        y = (torch.from_numpy(rng.standard_normal(9)) * 100).to(dt)
    # torch's own arithmetic for floats (one rounding per step for float16/bfloat16), numpy's for the
    # rest (torch lacks add for some unsigned types): or for bool, wrapping for ints.
    want = x + y if name in FLOATS + COMPLEX else torch.from_numpy(x.numpy() + y.numpy())
    storage = x.untyped_storage().data_ptr()
    out = as_array(x, what="all_reduce tensor", writable=True)
    inp = as_array(y)
    assert out.dtype_name == inp.dtype_name == name and out.source == "torch"
    assert out.array.dtype == (np.uint16 if name == "bfloat16" else np.dtype(name))
    reduce_into(out.array, inp.array, R.SUM, dtype=out.dtype_name)
    assert x.untyped_storage().data_ptr() == storage
    assert torch.equal(x, want), (x, want)


@pytest.mark.torch
def test_torch_refusals_and_edge_cases() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(12.0).reshape(3, 4)
    with pytest.raises(ValueError, match=r"all_reduce tensor is not contiguous.*\.contiguous\(\)"):
        as_array(t.t(), what="all_reduce tensor", writable=True)
    c = as_array(t.t())
    assert c.copied and np.array_equal(c.array, t.t().numpy())
    with pytest.raises(ValueError, match="not contiguous"):
        as_array(torch.ones(1).expand(4), writable=True)
    with pytest.raises(TypeError, match="is on meta; the CPU backend takes CPU tensors"):
        as_array(torch.ones(2, device="meta"), writable=True)
    with pytest.raises(TypeError, match="sparse"):
        as_array(torch.ones(3).to_sparse())
    with pytest.raises(TypeError, match="complex32"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "ComplexHalf support is experimental"
        as_array(torch.ones(2, dtype=torch.complex32))
    with pytest.raises(TypeError, match="float8"):
        as_array(torch.ones(2).to(torch.float8_e4m3fn))
    z = torch.ones(3, dtype=torch.complex64).conj()
    with pytest.raises(ValueError, match=r"conj bit set.*resolve_conj"):
        as_array(z, writable=True)
    zc = as_array(z)
    assert zc.copied and zc.array.tolist() == [1 - 0j] * 3
    p = torch.nn.Parameter(torch.ones(3))  # requires grad: torch's c10d works on it, so do we
    reduce_into(as_array(p, writable=True).array, np.full(3, 2.0, np.float32), R.SUM)
    assert p.detach().tolist() == [3.0, 3.0, 3.0]
    e = torch.empty(0, dtype=torch.bfloat16)
    assert as_array(e, writable=True).array.shape == (0,)
    s = torch.tensor(2.0)
    finalize(as_array(s, writable=True).array, R.AVG, 4)
    assert s.item() == 0.5
    off = torch.arange(10, dtype=torch.int64)[3:7]  # an offset into the storage, contiguous
    reduce_into(as_array(off, writable=True).array, np.ones(4, np.int64), R.SUM)
    assert off.tolist() == [4, 5, 6, 7]


def test_types_module_stays_pure() -> None:
    path = pathlib.Path(T.__file__)
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & {"asyncio", "socket", "selectors", "threading", "torch", "cupy", "aiodist_cuda"}, imported


# -- bfloat16 -----------------------------------------------------------------------------------


def test_bfloat16_round_trip_every_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = bfloat16_to_float32(bits)
    assert f.dtype == np.float32
    assert ((f.view(np.uint32) >> 16) == bits).all() and (f.view(np.uint32) & 0xFFFF == 0).all()
    back = float32_to_bfloat16(f)
    nan = np.isnan(f)
    assert (back[~nan] == bits[~nan]).all()
    # a NaN stays a NaN of the same sign, made quiet
    assert ((back[nan] & 0x7FC0) == 0x7FC0).all() and ((back[nan] ^ bits[nan]) & ~np.uint16(0x0040) == 0).all()


def expected_bf16_bits(u: int) -> int:
    x = float(np.uint32(u).view(np.float32))
    if math.isnan(x):
        return ((u >> 16) | 0x40) & 0xFFFF
    y = round_to(x, "bfloat16")
    return int(np.float32(y).view(np.uint32)) >> 16


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40))
def test_float32_to_bfloat16_matches_the_scalar_reference(patterns: list[int]) -> None:
    u = np.array(patterns, dtype=np.uint32)
    got = float32_to_bfloat16(u.view(np.float32))
    assert got.tolist() == [expected_bf16_bits(p) for p in patterns]
    out = np.zeros(len(patterns), np.uint16)
    assert float32_to_bfloat16(u.view(np.float32), out=out) is out and out.tolist() == got.tolist()


@pytest.mark.parametrize(
    "pattern, want",
    [
        (0x3F808000, 0x3F80),  # a tie, down to even
        (0x3F818000, 0x3F82),  # a tie, up to even
        (0x3F808001, 0x3F81),  # just above a tie
        (0x7F7FFFFF, 0x7F80),  # the largest float32 overflows to inf
        (0x80000001, 0x8000),  # the smallest negative subnormal rounds to -0.0
        (0x00018000, 0x0002),  # subnormal tie to even
        (0x7F800000, 0x7F80),  # inf
        (0xFF800001, 0xFFC0),  # a negative signalling NaN: quiet, sign kept
    ],
)
def test_float32_to_bfloat16_cases(pattern: int, want: int) -> None:
    assert float32_to_bfloat16(np.array([pattern], np.uint32).view(np.float32)).tolist() == [want]


@pytest.mark.torch
def test_bfloat16_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    # float32 -> bfloat16: random bit patterns (every class: normal, subnormal, inf, NaN, -0.0)
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFF800001, 1, 0x807FFFFF, 0x3F808000], np.uint32)
    u = np.concatenate([rng.integers(0, 2**32, 200_000, dtype=np.uint32), specials])
    f = u.view(np.float32)
    ours = float32_to_bfloat16(f)
    theirs = torch.from_numpy(f.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(f)
    assert nan.any() and (ours[~nan] == theirs[~nan]).all()
    assert np.isnan(bfloat16_to_float32(ours[nan])).all()  # torch's NaN bits differ by path; NaN-ness does not
    # bfloat16 -> float32, every pattern
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    assert (bfloat16_to_float32(bits).view(np.uint32) == wide.view(np.uint32)).all()


@pytest.mark.torch
@pytest.mark.parametrize("op", [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, R.PREMUL_SUM], ids=lambda o: o.name)
def test_bfloat16_reductions_match_torch(op: R) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(int(op))
    n = 3
    values = [rng.standard_normal(5000) * np.exp2(rng.integers(-140, 128, 5000)) for _ in range(n)]
    for v in values:
        v[:8] = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -3e38, 3e38]
        rng.shuffle(v)
    ts = [torch.from_numpy(v).to(torch.bfloat16) for v in values]
    bits = [t.view(torch.int16).numpy().view(np.uint16).copy() for t in ts]
    the_op: ReduceOp | R = ReduceOp.PREMUL_SUM(0.3) if op == R.PREMUL_SUM else op
    ours = run_reduction(the_op, bits, "bfloat16")
    if op == R.PREMUL_SUM:
        f = torch.tensor(0.3, dtype=torch.bfloat16)
        ts = [t * f for t in ts]
    fold: Callable[[Any, Any], Any] = {R.SUM: torch.add, R.AVG: torch.add, R.PREMUL_SUM: torch.add, R.PRODUCT: torch.mul,
                                       R.MIN: torch.minimum, R.MAX: torch.maximum}[op]  # fmt: skip
    acc = ts[0]
    for t in ts[1:]:
        acc = fold(acc, t)
    if op == R.AVG:
        acc = acc / n
    theirs = acc.view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(bfloat16_to_float32(theirs))
    assert (np.isnan(bfloat16_to_float32(ours)) == nan).all()
    assert (ours[~nan] == theirs[~nan]).all(), np.flatnonzero(ours != theirs)[:10]


# -- hypothesis: reduce_into against numpy --------------------------------------------------------

NUMPY_NAMES = [n for n in ALL if n != "bfloat16"]
UFUNC = {R.SUM: np.add, R.PRODUCT: np.multiply, R.MIN: np.minimum, R.MAX: np.maximum,
         R.BAND: np.bitwise_and, R.BOR: np.bitwise_or, R.BXOR: np.bitwise_xor, R.AVG: np.add}  # fmt: skip


@st.composite
def reduction_cases(draw: st.DrawFn) -> tuple[str, R, np.ndarray, np.ndarray]:
    name = draw(st.sampled_from(NUMPY_NAMES))
    op = draw(st.sampled_from([o for o in UFUNC if EXPECTED[(name, o)]]))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6))
    a = draw(hnp.arrays(name, shape))
    b = draw(hnp.arrays(name, shape))
    return name, op, a, b


@settings(max_examples=300, deadline=None)
@given(reduction_cases())
def test_reduce_into_matches_numpy(case: tuple[str, R, np.ndarray, np.ndarray]) -> None:
    name, op, a, b = case
    with np.errstate(all="ignore"):
        if name in ("float16", "float32") and op in (R.SUM, R.AVG, R.PRODUCT):
            # one rounding of the exact result: float64 holds every sum/product of two of these exactly,
            # or rounds it so finely that rounding again is still the correct rounding.
            want = UFUNC[op](a.astype(np.float64), b.astype(np.float64)).astype(name)
        else:
            want = UFUNC[op](a, b)
        got = a.copy()
        reduce_into(got, b, op)
    assert got.dtype == a.dtype
    np.testing.assert_array_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(np.uint16, st.integers(0, 30)).flatmap(lambda a: st.tuples(st.just(a), hnp.arrays(np.uint16, a.shape))),
    st.sampled_from([R.SUM, R.PRODUCT, R.MIN, R.MAX]),
)
def test_bfloat16_reduce_matches_the_scalar_reference(pair: tuple[np.ndarray, np.ndarray], op: R) -> None:
    a, b = pair
    got = a.copy()
    reduce_into(got, b, op, dtype="bfloat16")
    for x, y, g in zip(from_storage(a, "bfloat16"), from_storage(b, "bfloat16"), from_storage(got, "bfloat16")):
        if math.isnan(x) or math.isnan(y):
            assert math.isnan(g)
            continue
        exact = x + y if op == R.SUM else x * y if op == R.PRODUCT else min(x, y) if op == R.MIN else max(x, y)
        want = round_value(exact, "bfloat16")
        assert (math.isnan(g) and math.isnan(want)) or g == want, (op, x, y, g, want)


# -- folder: the lane's fold of every rank's part, in rank order -------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "float16", "bfloat16"])
@pytest.mark.parametrize("nparts", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("op", [R.SUM, R.PRODUCT, R.MAX])
def test_fold_with_a_second_array_gives_the_bits_of_the_fold_in_place(dtype: str, nparts: int, op: R) -> None:
    """The fold that steps between ``out`` and ``tmp`` (numpy's in-place ufunc costs 2-3x on a
    small array) gives the same bits as the one in place and as ``combiner`` part after part,
    with out's last step in ``out`` whatever the number of parts."""
    rng = np.random.default_rng(nparts)
    storage = np.uint16 if dtype == "bfloat16" else dtype
    parts = [
        (rng.standard_normal(7) * 3).astype(np.float32).view(np.uint32).astype(np.uint16)
        if dtype == "bfloat16"
        else (rng.standard_normal(7) * 3).astype(storage)
        for _ in range(nparts)
    ]
    fold = folder(op, dtype)
    combine = combiner(op, dtype)
    want = parts[0].copy()
    for p in parts[1:]:
        combine(want, p)
    in_place = np.empty_like(parts[0])
    fold(in_place, parts)
    stepped = np.full_like(parts[0], 99)
    tmp = np.full_like(parts[0], 77)
    fold(stepped, parts, tmp)
    np.testing.assert_array_equal(in_place.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(stepped.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", [R.MIN, R.MAX])
@pytest.mark.parametrize("with_tmp", [False, True], ids=["no-tmp", "tmp"])
def test_a_pairs_fold_into_one_of_its_parts_keeps_rank_order(dtype: str, op: R, with_tmp: bool) -> None:
    """A pair folds its own part straight from its buffer (``out`` is one of the two parts):
    the result's bits are rank order's whichever it is, as the MIN and MAX of +0 and -0 show
    (rank 0 +0, rank 1 -0)."""
    bf = dtype == "bfloat16"

    def zeros(neg: bool) -> np.ndarray:
        x = np.full(5, -0.0 if neg else 0.0, np.float32)
        return (x.view(np.uint32) >> 16).astype(np.uint16) if bf else x

    fold = folder(op, dtype)
    want = zeros(False)
    combiner(op, dtype)(want, zeros(True))  # rank order: rank 0's part first
    for me in (0, 1):
        out = zeros(me == 1)
        other = zeros(me == 0)
        parts = [out, other] if me == 0 else [other, out]
        fold(out, parts, np.empty_like(out) if with_tmp else None)
        np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8), err_msg=f"rank {me}")


def test_fold_and_combine_are_quiet_on_overflow_and_leave_the_callers_error_state() -> None:
    """A floating reduction that overflows gives inf with no warning (as torch's), in the loop's
    thread and in another, and the caller's own numpy error state is untouched after it."""
    import threading

    big = np.full(3, 3e38, np.float32)
    fold = folder(R.SUM, "float32")
    combine = combiner(R.SUM, "float32")

    def run() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = np.empty_like(big)
            fold(out, [big, big, big], np.empty_like(big))
            assert np.isinf(out).all()
            acc = big.copy()
            combine(acc, big)
            assert np.isinf(acc).all()

    run()
    errs: list[BaseException] = []

    def in_thread() -> None:
        try:
            run()
        except BaseException as exc:  # (reported below, in the test's thread)
            errs.append(exc)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert not errs
    with np.errstate(over="raise"):
        fold(np.empty_like(big), [big, big])  # quiet inside the fold ...
        with pytest.raises(FloatingPointError):
            big * np.float32(10)  # ... and the caller's state as it set it
