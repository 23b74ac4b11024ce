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
    parser.add_argument("libfuzzer", nargs="*", help="extra libFuzzer flags (after --)")
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
    if args.merge:
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
    atheris.Setup([sys.argv[0], *flags, *args.libfuzzer], TARGETS[args.target])
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
