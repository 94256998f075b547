"""aiodist_cuda's CPU-side parts, with no GPU and (in CI) no CuPy: the NCCL dtype and op tables,
the layouts of the grouped ops, the error mapping, device_id parsing, the two-ranks-one-GPU
check, availability and its reasons, registration and packaging."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import tomllib
import types

import pytest

import aiodist
import aiodist_cuda
from aiodist import ReduceOp
from aiodist.c10d.backend_registry import Backend
from aiodist.errors import DistBackendError
from aiodist_cuda import _cupy
from aiodist_cuda._plans import Part, exchange_plan, split_bounds
from aiodist_cuda._tables import NCCL_DTYPES, nccl_error_name, nccl_hint, nccl_op, wire_dtype
from aiodist_cuda.backend import NcclOptions, _Comm, nccl_error, parse_device

HAS_CUPY = importlib.util.find_spec("cupy") is not None

# -- dtypes ---------------------------------------------------------------------------------------

EXPECTED = {
    "int8": (0, 1),
    "uint8": (1, 1),
    "bool": (1, 1),
    "int32": (2, 1),
    "uint32": (3, 1),
    "int64": (4, 1),
    "uint64": (5, 1),
    "float16": (6, 1),
    "float32": (7, 1),
    "float64": (8, 1),
    "bfloat16": (9, 1),
    "complex64": (7, 2),
    "complex128": (8, 2),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dtype_maps_to_nccls(name: str) -> None:
    w = wire_dtype(name, "t")
    assert (w.nccl, w.per_element) == EXPECTED[name]


def test_table_is_the_expected_one() -> None:
    assert NCCL_DTYPES == EXPECTED


@pytest.mark.parametrize("name", ["int16", "uint16", "float128", "object"])
def test_dtypes_nccl_lacks_are_refused(name: str) -> None:
    with pytest.raises(TypeError, match=f"all_reduce tensor has dtype {name}"):
        wire_dtype(name, "all_reduce tensor")


def test_16_bit_integers_say_why() -> None:
    with pytest.raises(TypeError, match="no 16-bit integer"):
        wire_dtype("int16", "t")


# -- ops ------------------------------------------------------------------------------------------

NUMERIC = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64", "bfloat16"]


@pytest.mark.parametrize("dtype", NUMERIC)
@pytest.mark.parametrize(
    ("op", "code"), [(ReduceOp.SUM, 0), (ReduceOp.PRODUCT, 1), (ReduceOp.MAX, 2), (ReduceOp.MIN, 3), (ReduceOp.AVG, 4)]
)
def test_plain_ops_map_to_ncclred(dtype: str, op: object, code: int) -> None:
    assert nccl_op(op, dtype, "x") == (code, None)


@pytest.mark.parametrize("dtype", NUMERIC + ["bool", "complex64", "complex128"])
@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
def test_bitwise_ops_are_refused(dtype: str, op: object) -> None:
    if dtype.startswith("complex"):  # torch's words and type (ValueError; still a TypeError)
        with pytest.raises(ValueError, match=r"^all_reduce does not support RedOpType\.B[A-Z]+ on complex tensors"):
            nccl_op(op, dtype, "all_reduce")
        return
    with pytest.raises(TypeError, match="NCCL has no bitwise reductions"):
        nccl_op(op, dtype, "all_reduce")


def test_bool_is_or_and_and() -> None:
    assert nccl_op(ReduceOp.SUM, "bool", "x") == (2, None)  # MAX: or
    assert nccl_op(ReduceOp.MAX, "bool", "x") == (2, None)
    assert nccl_op(ReduceOp.PRODUCT, "bool", "x") == (3, None)  # MIN: and
    assert nccl_op(ReduceOp.MIN, "bool", "x") == (3, None)
    with pytest.raises(TypeError, match="AVG is not supported on bool"):
        nccl_op(ReduceOp.AVG, "bool", "x")
    with pytest.raises(TypeError, match="PREMUL_SUM is not supported on bool"):
        nccl_op(ReduceOp.PREMUL_SUM(2.0), "bool", "x")


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_sum_and_avg_only(dtype: str) -> None:
    assert nccl_op(ReduceOp.SUM, dtype, "x") == (0, None)
    assert nccl_op(ReduceOp.AVG, dtype, "x") == (4, None)
    for op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PREMUL_SUM(2.0)):
        with pytest.raises(TypeError, match="complex: SUM and AVG only"):
            nccl_op(op, dtype, "x")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_premul_sum_carries_its_factor(dtype: str) -> None:
    assert nccl_op(ReduceOp.PREMUL_SUM(0.25), dtype, "x") == (0, 0.25)


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8"])
def test_premul_sum_needs_a_float(dtype: str) -> None:
    with pytest.raises(TypeError, match="PREMUL_SUM needs a floating dtype"):
        nccl_op(ReduceOp.PREMUL_SUM(2.0), dtype, "x")


def test_a_dtype_nccl_lacks_is_refused_before_the_op() -> None:
    with pytest.raises(TypeError, match="dtype int16"):
        nccl_op(ReduceOp.BAND, "int16", "x")


def test_op_must_be_a_reduce_op() -> None:
    assert nccl_op(ReduceOp(ReduceOp.MIN), "float32", "x") == (3, None)
    with pytest.raises(TypeError, match="must be a ReduceOp"):
        nccl_op("max", "float32", "x")


# -- layouts --------------------------------------------------------------------------------------


def test_split_bounds_even_and_uneven() -> None:
    assert split_bounds(6, 4, None, 3, "x") == [(0, 8), (8, 8), (16, 8)]
    assert split_bounds(6, 2, [1, 0, 5], 3, "x") == [(0, 2), (2, 0), (2, 10)]


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        (None, "must divide equally"),
        ([], "must divide equally"),  # empty is equal parts, as in torch
        ([1, 2], "must be a list of 3 ints"),
        ("12", "must be a list of 3 ints"),
        ([1, -1, 6], "non-negative"),
        ([1.0, 2, 2], "non-negative ints"),
        ([1, 1, 1], "add up to 3"),
    ],
)
def test_split_bounds_refusals(sizes: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_bounds(5, 1, sizes, 3, "all_to_all_single input_split_sizes")  # type: ignore[arg-type]


def test_split_bounds_empty_is_equal() -> None:
    assert split_bounds(6, 1, [], 3, "x") == [(0, 2), (2, 2), (4, 2)]


def test_exchange_plan_skips_empty_parts_and_copies_its_own() -> None:
    sends = [(0, 2), (2, 0), (2, 3)]
    recvs = [(0, 1), (1, 0), (1, 4)]
    out, inc, own = exchange_plan(1, sends, recvs)
    assert out == [Part(0, 0, 2), Part(2, 2, 3)]
    assert inc == [Part(0, 0, 1), Part(2, 1, 4)]
    assert own is None
    out, inc, own = exchange_plan(2, sends, [(0, 2), (2, 0), (3, 3)])
    assert own == (2, 3, 3)
    assert out == [Part(0, 0, 2)] and inc == [Part(0, 0, 2)]


def test_exchange_plan_own_part_must_agree() -> None:
    with pytest.raises(ValueError, match="sends itself 2 elements but expects 1"):
        exchange_plan(0, [(0, 2), (2, 1)], [(0, 1), (1, 1)])
    assert exchange_plan(0, [(0, 2), (2, 1)], [(5, 2), (7, 1)])[2] == (0, 5, 2)


# -- errors ---------------------------------------------------------------------------------------


class NcclError(RuntimeError):  # named as CuPy's: only an NcclError's status is an NCCL result
    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.status = status


class CUDARuntimeError(NcclError):  # CuPy's CUDA errors carry a status too, of another enum
    pass


@pytest.mark.parametrize(
    ("status", "name", "hint"),
    [(5, "ncclInvalidUsage", "set the device from LOCAL_RANK"), (2, "ncclSystemError", "/dev/shm"), (6, "ncclRemoteError", "remote rank")],
)
def test_nccl_errors_become_dist_backend_errors_with_a_hint(status: int, name: str, hint: str) -> None:
    err = nccl_error(NcclError(status), "all_reduce on default_pg, seq 3")
    assert isinstance(err, DistBackendError)
    text = str(err)
    assert text.startswith("all_reduce on default_pg, seq 3: NCCL error " + name)
    assert hint in text
    assert isinstance(err.__cause__, NcclError)


def test_a_cuda_error_is_not_read_as_an_nccl_result() -> None:
    text = str(nccl_error(CUDARuntimeError(2), "op"))
    assert "ncclSystemError" not in text and text.startswith("op: CUDARuntimeError")


def test_cupys_key_error_for_results_it_cannot_name() -> None:
    text = str(nccl_error(KeyError(6), "op"))  # CuPy's NcclError knows results 0-5 only
    assert "ncclRemoteError" in text and "remote rank" in text


def test_unknown_status_and_other_errors() -> None:
    assert nccl_error_name(99) == "ncclResult 99"
    assert nccl_hint(99) == ""
    err = nccl_error(ValueError("boom"), "op")
    assert str(err) == "op: ValueError: boom"


def test_two_ranks_on_one_gpu_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    me = types.SimpleNamespace(desc="default_pg (id 0, ranks [0, 1, 2])")
    pg = types.SimpleNamespace(ranks=(0, 1, 2))
    _Comm._check_devices(me, ["a:0", "a:1", "b:0"], pg)  # type: ignore[arg-type]  # different devices or hosts: fine
    with pytest.raises(DistBackendError, match=r"ranks 0 and 2 both use cuda:0 on a; set the device from LOCAL_RANK"):
        _Comm._check_devices(me, ["a:0", "a:1", "a:0"], pg)  # type: ignore[arg-type]
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")  # NCCL >= 2.30 may share a GPU when asked
    _Comm._check_devices(me, ["a:0", "a:0", "a:0"], pg)  # type: ignore[arg-type]


# -- device_id ------------------------------------------------------------------------------------


class _TorchDevice:
    def __init__(self, type: str, index: int | None) -> None:
        self.type, self.index = type, index


@pytest.mark.parametrize(
    ("given", "index"), [(0, 0), (3, 3), ("cuda:2", 2), (_TorchDevice("cuda", 1), 1), (types.SimpleNamespace(id=4), 4)]
)
def test_parse_device(given: object, index: int) -> None:
    assert parse_device(given) == index


@pytest.mark.parametrize("given", ["cpu", "cpu:0", _TorchDevice("cpu", None), -1])
def test_parse_device_refuses_non_cuda(given: object) -> None:
    with pytest.raises(ValueError):
        parse_device(given)


@pytest.mark.parametrize("given", [True, 1.5, object()])
def test_parse_device_refuses_other_types(given: object) -> None:
    with pytest.raises(TypeError):
        parse_device(given)


# -- availability, registration, packaging --------------------------------------------------------


def test_reason_is_truthful() -> None:
    if not HAS_CUPY:
        assert aiodist_cuda.is_available() is False
        assert "CuPy is not installed" in aiodist_cuda.unavailable_reason()
        assert "aiodist[cuda]" in aiodist_cuda.unavailable_reason()
    assert aiodist_cuda.is_available() == (aiodist_cuda.unavailable_reason() == "")
    assert aiodist.is_nccl_available() == aiodist_cuda.is_available()
    assert aiodist.is_backend_available("nccl") == aiodist_cuda.is_available()


def test_disable_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_CUDA_DISABLE", "1")
    monkeypatch.setattr(_cupy, "_state", {})
    assert aiodist_cuda.is_available() is False
    assert aiodist_cuda.unavailable_reason() == "AIODIST_CUDA_DISABLE=1 is set"
    with pytest.raises(DistBackendError, match="AIODIST_CUDA_DISABLE"):
        _cupy.load()


def test_registered_through_the_registry() -> None:
    assert "nccl" in Backend._plugins
    assert Backend._plugins["nccl"].devices == ("cuda",)
    assert Backend._plugins["nccl"].extended_api is True
    aiodist_cuda.register()  # idempotent
    from aiodist.backends.device import stager_for

    assert stager_for("cuda") is not None


def test_entry_points_are_installed() -> None:
    (nccl,) = importlib.metadata.entry_points(group="aiodist.backends", name="nccl")
    (cuda,) = importlib.metadata.entry_points(group="aiodist.devices", name="cuda")
    assert nccl.value == cuda.value == "aiodist_cuda:register"


def test_cuda_extra_installs_cupy_and_nccl() -> None:
    meta = tomllib.loads((pathlib.Path(aiodist_cuda.__file__).parent.parent / "pyproject.toml").read_text())
    extra = meta["project"]["optional-dependencies"]["cuda"]
    assert any(r.startswith("cupy-cuda12x") for r in extra)
    assert any(r.startswith("nvidia-nccl-cu12") for r in extra)
    assert meta["project"]["entry-points"]["aiodist.backends"]["nccl"] == "aiodist_cuda:register"


def test_nccl_options() -> None:
    assert NcclOptions().is_high_priority_stream is False
    assert aiodist_cuda.NcclOptions(is_high_priority_stream=True).is_high_priority_stream is True


@pytest.mark.skipif(aiodist_cuda.is_available(), reason="a GPU is here: the backend would be made")
async def test_nccl_refused_with_the_reason() -> None:
    store = aiodist.HashStore()
    with pytest.raises(DistBackendError, match=r"backend 'nccl' is not available: " + ("CuPy is not installed" if not HAS_CUPY else "")):
        await aiodist.init_process_group("nccl", store=store, rank=0, world_size=1)
    assert not aiodist.is_initialized()
    with pytest.raises(DistBackendError, match="backend 'nccl' is not available"):
        await aiodist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    assert not aiodist.is_initialized()


@pytest.mark.skipif(aiodist_cuda.is_available(), reason="a GPU is here")
async def test_default_backend_is_gloo_without_nccl() -> None:
    await aiodist.init_process_group(store=aiodist.HashStore(), rank=0, world_size=1)
    try:
        assert aiodist.get_backend() == "gloo"
        assert aiodist.get_backend_config() == "cpu:gloo"
    finally:
        await aiodist.destroy_process_group()


def test_supported_ops_cover_the_cpu_collectives() -> None:
    from aiodist.c10d import collectives

    wanted = set(collectives.__all__) - {"monitored_barrier"}  # monitored_barrier is gloo's only, as in torch
    assert wanted <= set(aiodist_cuda.SUPPORTED_OPS)
    assert "p2p" in aiodist_cuda.SUPPORTED_OPS
