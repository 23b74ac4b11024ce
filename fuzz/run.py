"""Run one fuzz target under atheris (libFuzzer, coverage-guided) for a bounded time.

    python -m fuzz.run TARGET [--seconds 300] [-- LIBFUZZER_FLAGS...]

The repo's corpus ``fuzz/corpus/<target>/`` seeds the run (read only); what the run finds
that adds coverage goes to ``.fuzz/corpus/<target>/`` (ignored by git, kept between runs), a
crashing input to ``.fuzz/findings/<target>-crash-*``. ``--merge`` instead merges the work
corpus into the repo's, keeping only inputs that add coverage (to commit a richer seed set).
A finding becomes a file in ``fuzz/regressions/<target>/``, which ``make test`` replays.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
WORK_DIR = FUZZ_DIR.parent / ".fuzz"
# Our code (and the gguf reader) is instrumented for coverage; torch, numpy, protobuf are not.
INSTRUMENTED = ["server", "model_runner", "scheduler", "gguf", "fuzz"]
TARGET_NAMES = ("openai_parser", "request_validation", "detokenizer", "gguf_header")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.run", description=__doc__.split("\n")[0])
    parser.add_argument("target", choices=TARGET_NAMES)
    parser.add_argument("--seconds", type=int, default=300, help="run this long (default 300)")
    parser.add_argument("--merge", action="store_true", help="merge the work corpus into fuzz/")
    # libFuzzer's merge re-runs argv[0] with its own flags: _child_command() is that argv[0].
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []  # libFuzzer flags, after --
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    args = parser.parse_args(argv)

    import atheris  # the fuzz extra: pip install -e '.[fuzz]' (make fuzz does)

    with atheris.instrument_imports(include=INSTRUMENTED):
        import gguf  # noqa: F401  (the loader imports it lazily: instrument it now)

        from fuzz.targets import TARGETS

    seeds = FUZZ_DIR / "corpus" / args.target
    work = WORK_DIR / "corpus" / args.target
    findings = WORK_DIR / "findings"
    work.mkdir(parents=True, exist_ok=True)
    findings.mkdir(parents=True, exist_ok=True)
    if args.child:
        flags = []
    elif args.merge:
        flags = ["-merge=1", str(seeds), str(work)]
    else:
        flags = [
            str(work),
            str(seeds),
            f"-max_total_time={args.seconds}",
            f"-artifact_prefix={findings}/{args.target}-",
            "-rss_limit_mb=2048",
            "-timeout=10",
            "-max_len=4096",
            "-print_final_stats=1",
        ]
    argv0 = _child_command(args.target) if args.merge else sys.argv[0]
    atheris.Setup([argv0, *flags, *extra], TARGETS[args.target])
    atheris.Fuzz()
    return 0


def _child_command(target: str) -> str:
    """An executable that runs this target with the flags libFuzzer gives it."""
    script = WORK_DIR / f"child-{target}.sh"
    script.write_text(
        f"#!/bin/sh\ncd {FUZZ_DIR.parent} && exec {sys.executable} -m fuzz.run {target} "
        '--child -- "$@"\n'
    )
    script.chmod(0o755)
    return str(script)


if __name__ == "__main__":
    sys.exit(main())
