"""Command line: ``python -m cuflash <command> [options]``.

Each command lives in its own module and exposes ``main(argv) -> int``; this file only
dispatches, so ``python -m cuflash`` works from a source tree (``PYTHONPATH=.``) and from an
installed package alike.
"""

from __future__ import annotations

import importlib
import sys

# command name -> (module, one-line help)
COMMANDS = {
    "demo": ("cuflash.tools.demo", "run a real language model (SmolLM2-135M) with cuflash attention"),
    "bench": ("cuflash.tools.bench", "forward attention throughput on the local GPU vs. baselines (table, --json, --plot)"),
    "intensity": ("cuflash.analysis.intensity", "FLOPs, HBM bytes, arithmetic intensity and roofline time"),
    "roofline": ("cuflash.analysis.roofline", "per-pipe model of a kernel's main loop, read from its SASS (no GPU)"),
    "check": ("cuflash.tools.check", "GPU self-check: compile every kernel, correctness grid, interop, graphs"),
}


def _usage() -> str:
    lines = ["usage: python -m cuflash <command> [options]", "", "commands:"]
    for name, (_, text) in COMMANDS.items():
        lines.append(f"  {name:<10} {text}")
    lines.append("")
    lines.append("Run 'python -m cuflash <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"cuflash: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
