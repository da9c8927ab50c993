"""Command line: ``python -m cuflash <command> [options]`` and ``python -m cuflash --version``.

Each command lives in its own module and exposes ``main(argv) -> int``; this file only
dispatches, so ``python -m cuflash`` works from a source tree (``PYTHONPATH=.``) and from an
installed package alike. Errors have argparse's form, ``python -m cuflash[ <command>]: error:
...``, with exit status 2. Output piped into a reader that stops early (``| head``) ends the
command quietly with the shell's status for a closed pipe (141).
"""

from __future__ import annotations

import importlib
import os
import sys

PROG = "python -m cuflash"

# command name -> (module, one-line help)
COMMANDS = {
    "demo": ("cuflash.tools.demo", "run a real language model (SmolLM2-135M) with cuflash attention"),
    "bench": ("cuflash.tools.bench", "attention throughput on the local GPU vs. baselines; --cpu: the CPU path"),
    "intensity": ("cuflash.analysis.intensity", "FLOPs, HBM bytes, arithmetic intensity and roofline time"),
    "roofline": ("cuflash.analysis.roofline", "per-pipe model of a kernel's main loop, read from its SASS (no GPU)"),
    "check": ("cuflash.tools.check", "GPU self-check: compile every kernel, correctness grid, interop, graphs"),
}

#: exit status after the reader of stdout went away (128 + SIGPIPE, what a shell reports)
BROKEN_PIPE_STATUS = 141


def _usage() -> str:
    lines = [f"usage: {PROG} <command> [options]", f"       {PROG} --version", "", "commands:"]
    for name, (_, text) in COMMANDS.items():
        lines.append(f"  {name:<10} {text}")
    lines.append("")
    lines.append(f"Run '{PROG} <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv and argv[0] == "--version":
        from cuflash import __version__

        print(f"cuflash {__version__}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = ("a command is required" if not argv else
                   f"unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})")
        print(f"{_usage()}\n{PROG}: error: {problem}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


def run() -> int:
    """:func:`main` for the interpreter: a closed stdout ends the command quietly."""
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit; point it at devnull so that flush cannot fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_STATUS
    return status


if __name__ == "__main__":
    sys.exit(run())
