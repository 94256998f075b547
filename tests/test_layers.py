"""Import layering, checked on the source: wire/ is sans-I/O (no asyncio, no sockets), and
aiodist never imports aiodist_cuda or cupy; the debug instrumentation (aiodist/_instrument) sits
below c10d and the debug tools above it, and ``import aiodist`` loads no aiohttp. Plus the public
surface and the error tree."""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import subprocess
import sys

import aiodist
import aiodist_cuda

ROOT = pathlib.Path(aiodist.__file__).parent


def imported_modules(path: pathlib.Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_wire_is_sans_io() -> None:
    files = list((ROOT / "wire").glob("*.py"))
    assert files
    for f in files:
        bad = imported_modules(f) & {"asyncio", "socket", "selectors", "uvloop", "aiohttp", "threading"}
        assert not bad, f"{f.name} imports {bad}: wire/ must stay sans-I/O"


def test_aiodist_never_imports_cuda() -> None:
    for f in ROOT.rglob("*.py"):
        bad = imported_modules(f) & {"aiodist_cuda", "cupy"}
        assert not bad, f"{f.relative_to(ROOT.parent)} imports {bad}"


def test_import_aiodist_loads_no_cuda_module() -> None:
    code = "import sys, aiodist; print(sorted(m for m in sys.modules if m.startswith(('cupy', 'aiodist_cuda', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


def imported_names(path: pathlib.Path) -> set[str]:
    """Every absolute module name ``path`` imports, in full (``aiodist.c10d.world``), at any depth."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


#: the debug tools, above c10d (they read Worlds and groups); c10d and the instrumentation never import them
DEBUG_TOOLS = (
    "aiodist.debug.server",
    "aiodist.debug.handlers",
    "aiodist.debug.analyze",
    "aiodist.debug.breakpoint",
    "aiodist.debug.recorder",  # (c10d's timeout dump goes through the instrumentation's dump_groups)
)


def test_debug_instrumentation_is_below_c10d() -> None:
    """aiodist/_instrument (levels, logs, recorder, desync, loop watchdog) imports nothing from
    c10d, the debug tools or aiohttp, even inside functions: c10d passes its groups in."""
    files = list((ROOT / "_instrument").glob("*.py"))
    assert len(files) >= 5
    for f in files:
        names = imported_names(f)
        bad = {n for n in names if n.startswith(("aiodist.c10d", "aiodist.debug", "aiohttp"))}
        assert not bad, f"{f.name} imports {sorted(bad)}: the instrumentation stays below c10d"


def test_debug_tools_are_above_c10d() -> None:
    """Neither c10d nor the instrumentation imports the debug tools (or aiohttp), even inside
    functions; ``import aiodist`` loading none of them is checked by running it (below)."""
    for f in [*(ROOT / "c10d").glob("*.py"), *(ROOT / "_instrument").glob("*.py")]:
        bad = {n for n in imported_names(f) if n.startswith((*DEBUG_TOOLS, "aiohttp"))}
        assert not bad, f"{f.relative_to(ROOT.parent)} imports {sorted(bad)}: the debug tools sit above c10d"


def test_the_instrumentation_imports_no_schedule() -> None:
    """aiodist/_instrument sits below the schedules too: DETAIL's fingerprint exchange gets its
    way of running sends and receives together passed in (c10d passes the schedules' together)."""
    for f in (ROOT / "_instrument").glob("*.py"):
        bad = {n for n in imported_names(f) if n.startswith(("aiodist.algorithms", "aiodist.backends", "aiodist.shm", "aiodist.transport"))}
        assert not bad, f"{f.name} imports {sorted(bad)}: the instrumentation stays below the schedules"


def test_import_aiodist_loads_no_aiohttp() -> None:
    code = "import sys, aiodist; print('aiohttp' in sys.modules, 'aiodist.debug.server' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "False False"


def test_public_surface() -> None:
    for name in aiodist.__all__:
        assert hasattr(aiodist, name), name
    for name in ("TCPStore", "HashStore", "FileStore", "PrefixStore", "Store", "rendezvous", "register_rendezvous_handler"):
        assert name in aiodist.__all__


def test_error_tree() -> None:
    assert issubclass(aiodist.DistError, RuntimeError)
    for cls in (aiodist.DistBackendError, aiodist.DistNetworkError, aiodist.DistStoreError):
        assert issubclass(cls, aiodist.DistError)
    assert issubclass(aiodist.QueueEmptyError, aiodist.DistStoreError)
    assert issubclass(aiodist.DistTimeoutError, aiodist.DistError) and issubclass(aiodist.DistTimeoutError, TimeoutError)
    assert issubclass(aiodist.StoreTimeoutError, aiodist.DistStoreError) and issubclass(aiodist.StoreTimeoutError, TimeoutError)


def test_aiodist_cuda_imports_cupy_only_when_used() -> None:
    """aiodist_cuda imports without CuPy: no module of it imports cupy at its top level."""
    root = pathlib.Path(aiodist_cuda.__file__).parent
    for f in root.glob("*.py"):
        tree = ast.parse(f.read_text(), str(f))
        for node in tree.body:  # top level only: imports inside functions run on first use
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] in ("cupy", "cupyx") for n in names), f"{f.name} imports CuPy at import time"


def aiodist_imports_closure(start: list[pathlib.Path]) -> dict[str, str]:
    """Every aiodist module the files ``start`` import, at any depth and through each other (and
    the packages above them, but ``aiodist`` itself, which re-exports everything), each with
    the module that first imported it."""
    seen: dict[str, str] = {}
    todo = [(f, "") for f in start]
    while todo:
        f, _ = todo.pop()
        for name in sorted(imported_names(f)):
            parts = name.split(".")
            if parts[0] != "aiodist":
                continue
            for depth in range(2, len(parts) + 1):  # the packages on the way, then the module
                mod = ".".join(parts[:depth])
                rel = ROOT.joinpath(*parts[1:depth])
                path = rel.with_suffix(".py") if rel.with_suffix(".py").is_file() else rel / "__init__.py"
                if not path.is_file() or mod in seen:
                    continue
                seen[mod] = str(f.relative_to(ROOT.parent))
                todo.append((path, mod))
    return seen


def test_transport_does_not_import_algorithms() -> None:
    """aiodist.transport sits below the collective algorithms (it carries their messages): no
    module it imports, directly or through another, is aiodist.algorithms (byte_view and the
    tag limits live in aiodist/_message.py)."""
    closure = aiodist_imports_closure(sorted((ROOT / "transport").glob("*.py")))
    assert "aiodist.wire.frame" in closure
    bad = {m: by for m, by in closure.items() if m.startswith(("aiodist.algorithms", "aiodist.backends", "aiodist.c10d"))}
    assert not bad, f"the transport imports {bad} (module: imported by): it must stay below the algorithms"


def test_the_training_layer_sits_above_c10d() -> None:
    """aiodist/nn and the DDP comm hooks use c10d only through its public package (never its
    modules), and nothing below them imports them; only ``distributed.py`` imports torch."""
    files = [*(ROOT / "nn").rglob("*.py"), *(ROOT / "algorithms" / "ddp_comm_hooks").glob("*.py")]
    assert len(files) >= 6
    for f in files:
        names = imported_names(f)
        private = {n for n in names if n.startswith("aiodist.c10d.") and n.split(".")[2] not in aiodist.c10d.__all__}
        assert not private, f"{f.relative_to(ROOT.parent)} imports c10d internals {sorted(private)}"
        if f.name != "distributed.py":
            assert "torch" not in {n.split(".")[0] for n in names}, f"{f.name} imports torch"
    below = [
        p
        for p in ROOT.rglob("*.py")
        if not p.is_relative_to(ROOT / "nn")
        and not p.is_relative_to(ROOT / "bench")
        and not p.is_relative_to(ROOT / "algorithms" / "ddp_comm_hooks")
    ]
    for f in below:
        bad = {n for n in imported_names(f) if n.startswith(("aiodist.nn", "aiodist.algorithms.ddp_comm_hooks"))}
        assert not bad, f"{f.relative_to(ROOT.parent)} imports the training layer: {sorted(bad)}"


def test_c10d_chooses_no_path() -> None:
    """The path an op takes (socket, lane, halves, single copy) is the backend's
    (aiodist/backends/routes.py): c10d neither plans (aiodist.algorithms.plan) nor reaches the
    shared-memory paths (aiodist.shm, but for its typed OpLink contract, which the runner's
    tracker implements), nor reads a plan's path or a shared-memory ticket."""
    for f in (ROOT / "c10d").glob("*.py"):
        names = imported_names(f)
        bad = {
            n
            for n in names
            if n.startswith("aiodist.algorithms.plan") or (n.startswith("aiodist.shm") and not n.startswith("aiodist.shm._link"))
        }
        assert not bad, f"{f.relative_to(ROOT.parent)} imports {sorted(bad)}: path policy belongs to aiodist.backends.routes"
        attrs = {n.attr for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Attribute)}
        chosen = attrs & {"single_copy", "lane", "ticket", "lane_now", "shm"}
        assert not chosen, f"{f.relative_to(ROOT.parent)} reads {sorted(chosen)}: path policy belongs to aiodist.backends.routes"


PACKAGES = (ROOT, pathlib.Path(aiodist_cuda.__file__).parent)
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def _modules() -> dict[str, pathlib.Path]:
    mods: dict[str, pathlib.Path] = {}
    for pkg in PACKAGES:
        for path in pkg.rglob("*.py"):
            name = ".".join(path.relative_to(pkg.parent).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _module_graph() -> dict[str, set[str]]:
    """Each module of aiodist and aiodist_cuda -> the modules of both it imports anywhere in it:
    top-level, in function bodies (lazy), and under ``if TYPE_CHECKING:`` (a type-only edge is a
    coupling all the same). A fresh copy each call (the sources are parsed once per run)."""
    return {m: set(e) for m, e in _parsed_graph().items()}


@functools.cache
def _parsed_graph() -> dict[str, frozenset[str]]:
    mods = _modules()
    graph: dict[str, frozenset[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                found.update(subs or [base])
        edges = set()
        for m in found:
            while m and m not in mods:
                m = m.rpartition(".")[0]
            if m and m != name:
                edges.add(m)
        graph[name] = frozenset(edges)
    return graph


def layer_table(text: str | None = None) -> list[tuple[str, list[str]]]:
    """docs/architecture.md's layer table, top layer first: (layer, the paths it holds)."""
    text = ARCHITECTURE.read_text() if text is None else text
    section = text[text.index("## Layers") :]
    rows: list[tuple[str, list[str]]] = []
    for line in section.splitlines():
        if line.startswith("|") and "`aiodist" in line:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append((cells[0], re.findall(r"`(aiodist[^`]*)`", cells[1])))
        elif rows and not line.startswith("|"):
            break
    return rows


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> int | None:
    """The index (0: top) of the layer whose longest path holds ``module``, or None."""
    path = module.replace(".", "/")
    best: tuple[int, int] | None = None
    for i, (_, paths) in enumerate(table):
        for p in paths:
            stem = p.removesuffix(".py").removesuffix("/__init__")
            # a file holds itself (a package's __init__.py: the package module), a folder its tree
            if path == stem or (not p.endswith(".py") and path.startswith(stem + "/")):
                if best is None or len(stem) > best[1]:
                    best = (i, len(stem))
    return None if best is None else best[0]


def upward_edges(graph: dict[str, set[str]], table: list[tuple[str, list[str]]]) -> list[str]:
    """Every edge from a module to one of a higher layer (a lower index), and every module the
    table does not place."""
    out = [f"{m}: in no layer of the table" for m in sorted(graph) if layer_of(m, table) is None]
    for m in sorted(graph):
        src = layer_of(m, table)
        for d in sorted(graph[m]):
            dst = layer_of(d, table)
            if src is not None and dst is not None and dst < src:
                out.append(f"{m} ({table[src][0]}) imports {d} ({table[dst][0]})")
    return out


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_every_import_edge_goes_down_the_layer_table() -> None:
    """docs/architecture.md's layer table places every module of aiodist and aiodist_cuda, and
    every import edge (top-level, lazy, TYPE_CHECKING) goes to the same layer or a lower one."""
    table = layer_table()
    assert [name for name, _ in table][:1] and len(table) >= 6, table
    graph = _module_graph()
    bad = upward_edges(graph, table)
    assert not bad, "edges against docs/architecture.md's layer table:\n" + "\n".join(bad)


def test_the_layer_check_catches_an_upward_edge_and_a_cycle() -> None:
    """Tried by adding one: the real graph with one upward edge (the wire codecs importing c10d),
    with a type-only cycle, and a table that misses a package."""
    table = layer_table()
    graph = _module_graph()
    graph["aiodist.wire.frame"] = {*graph["aiodist.wire.frame"], "aiodist.c10d.process_group"}
    assert upward_edges(graph, table) == ["aiodist.wire.frame (below everything) imports aiodist.c10d.process_group (torch API)"]
    graph = _module_graph()
    graph["aiodist.transport._inbox"] = {*graph["aiodist.transport._inbox"], "aiodist.transport._channel"}
    assert ["aiodist.transport._channel", "aiodist.transport._inbox"] in cycles_in(graph)
    assert any("in no layer" in b for b in upward_edges(_module_graph(), [row for row in table if "aiodist/shm" not in row[1]]))


def test_no_import_cycles_anywhere() -> None:
    """The whole graph, not pairs: no module reaches itself through imports of any kind
    (function-level and TYPE_CHECKING ones included: a lazy or type-only import only hides a
    cycle)."""
    graph = _module_graph()
    assert len(graph) > 100
    cycles = cycles_in(graph)
    assert not cycles, f"import cycles: {cycles}"
