"""``python -m aiodist.bench NAME [options]``: run one benchmark; with no name, the collectives
benchmark with its defaults; ``--help`` lists them."""

from __future__ import annotations

import importlib
import sys

# name -> (module with a ``main(argv) -> int``, one line for the listing). Modules are
# imported only when chosen, so listing stays instant.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "collectives": ("aiodist.bench.collectives", "collective time/algbw/busbw over a size sweep, nccl-tests style (--compare torch)"),
    "ddp": ("aiodist.bench.ddp", "a DDP training step (MLP; many small parameters), 2 and 4 ranks, vs torch DDP (--compare torch)"),
    "debug": ("aiodist.bench.debug", "what AIODIST_DEBUG OFF/INFO/DETAIL (and the flight recorder) cost per small all_reduce"),
    "hosts": ("aiodist.bench.hosts", "all_reduce across 2 netns hosts on tbf-shaped veth: one interface vs two striped, vs torch gloo"),
    "soak": ("aiodist.bench.soak", "RSS and fds over thousands of group lifecycles with mixed ops (--max-growth for a bound)"),
    "store": ("aiodist.bench.store", "TCPStore set/get/add ops/s and latency: aiodist (seq, pipelined) vs torch"),
}
DEFAULT = "collectives"  # what runs with no name


def usage() -> str:
    width = max(len(n) for n in BENCHMARKS)
    lines = [
        "usage: python -m aiodist.bench NAME [options]",
        "       python -m aiodist.bench NAME --help",
        f"       python -m aiodist.bench [options]  (runs {DEFAULT!r}: e.g. --compare torch)",
        "",
        "benchmarks:",
        *(f"  {name.ljust(width)}  {about}" for name, (_, about) in BENCHMARKS.items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    # no name, or options first (``python -m aiodist.bench --compare torch``): the default benchmark
    name, rest = (args[0], args[1:]) if args and not args[0].startswith("-") else (DEFAULT, args)
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[name][0])
    return int(module.main(rest))


# The guard matters beyond style: the benchmarks start 'spawn' worker processes, which
# re-import this module as __mp_main__ and must not run the benchmark again.
if __name__ == "__main__":
    sys.exit(main())
