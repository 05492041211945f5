"""Entry point of the ``kvroute`` console command.

Each subcommand lives in its own module exposing ``main(argv: list[str] | None) -> int``; this file only
dispatches, so adding a command never touches another layer's code. Modules are imported lazily so that
``kvroute --help`` stays fast and a missing optional dependency only affects its own command.
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

# command words -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("launch",): ("kvroute.launch.launcher", "start N workers plus the router, locally or on Ray"),
    ("router",): ("kvroute.router.server", "run the HTTP router in front of running workers"),
    ("worker",): ("kvroute.sim.server", "run one simulated engine as an HTTP worker"),
    ("sim",): ("kvroute.bench.sim_cli", "simulate one policy x eviction x workload"),
    ("compare",): ("kvroute.bench.compare", "simulate a policy x eviction matrix over workloads"),
    ("bench", "evict"): ("kvroute.bench.evict", "replay a trace through the cache core per eviction policy"),
    ("bench", "route"): ("kvroute.bench.route", "routing decision latency per policy"),
    ("bench", "serve"): ("kvroute.bench.serve", "open-loop load generator against a live endpoint"),
    ("bench", "engine-evict"): (
        "kvroute.bench.engine_evict",
        "eviction cost inside SGLang's and vLLM's own cache code",
    ),
}


def _version() -> str:
    try:
        return version("kvroute")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _usage() -> str:
    lines = ["usage: kvroute [--version] [--help] <command> [args]", "", "commands:"]
    for words, (_, text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<20} {text}")
    lines.append("")
    lines.append("Run 'kvroute <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"kvroute {_version()}")
        return 0
    for n in (2, 1):
        words = tuple(args[:n])
        if words in COMMANDS:
            module_name, _ = COMMANDS[words]
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.startswith("kvroute"):
                    print(
                        f"kvroute: command '{' '.join(words)}' cannot be loaded: {exc}",
                        file=sys.stderr,
                    )
                    return 2
                raise
            return int(module.main(args[n:]) or 0)
    print(f"kvroute: unknown command '{' '.join(args[:2])}'\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
