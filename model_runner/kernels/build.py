"""Compiling kvserve's kernels: the dispatcher library and one library per family.

``kernels.cpp`` (with the headers beside it) is compiled once without a family, into the
dispatcher (small: seconds), and once per family it is asked for. A family is one library,
compiled as several objects that run in parallel (one core object and one per format of
``KV_FORMATS``, whose tiles are most of the work) and then linked. ``make install`` builds the
dispatcher and the family this CPU runs (``python -m model_runner.kernels``); any other family
is built the first time something asks for it (``kernels.use_isa``, ``KVSERVE_ISA``, the
tests), and ``python -m model_runner.kernels --all`` builds every one now.

A library's file name carries a hash of the sources and of every flag, so an edit rebuilds
it, and builds are safe side by side: one process compiles a given library at a time (a lock
file beside it; the others wait and then use its result), into a temporary name that is
renamed into place only when whole.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from model_runner.environment import build_environment

SOURCE = Path(__file__).with_name("kernels.cpp")  # includes the headers beside it
# -Werror=switch: a switch over formats that misses one does not compile (kernels.cpp's
# KV_FORMATS generates them; none has a default).
FLAGS = (
    "-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-math-errno", "-ffp-contract=off",
    "-Werror=switch",
)  # fmt: skip
LINK_FLAGS = ("-shared", "-fopenmp", "-Wl,-z,defs")  # -z defs: a missing object fails the link


@dataclass(frozen=True)
class Family:
    """A way to compile the kernels: ``code`` is the dispatcher's number for it
    (``kernels.cpp``'s ``Isa``), ``flags`` the flags its objects add to ``FLAGS``."""

    code: int
    flags: tuple[str, ...] = ()
    x86: bool = False  # needs an x86-64 compiler
    split: bool = True  # one object per format, compiled in parallel (else one object)


AVX2 = ("-mavx2", "-mfma", "-mf16c")
FAMILIES: dict[str, Family] = {
    "portable": Family(0, split=False),  # seconds: one object
    "avx2": Family(1, AVX2, x86=True),
    "avx512": Family(
        2,
        (*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
         "-mprefer-vector-width=512"),
        x86=True,
    ),
    # The tests' families: the SIMD tiles' template over lanes emulated in plain C++ (qvec.h),
    # as the avx2 family runs it (maddubs), and as the avx512 family's ymm tiles and zmm pairs
    # run it (vpdpbusd). -Og: they only have to be exact (the results do not depend on the
    # optimization level: no fast-math, no contraction), and -Og compiles in seconds where
    # -O1's full unrolling of the emulated lanes takes minutes.
    "emu_avx2": Family(3, ("-DKV_EMULATE=8", "-DKV_EMULATE_VNNI=0", "-Og")),
    "emu_vnni8": Family(4, ("-DKV_EMULATE=8", "-DKV_EMULATE_VNNI=1", "-Og")),
    "emu_vnni16": Family(5, ("-DKV_EMULATE=16", "-DKV_EMULATE_VNNI=1", "-Og")),
}  # fmt: skip


def x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64")


def buildable() -> tuple[str, ...]:
    """The families this machine's compiler can build (x86 ones only on x86-64)."""
    return tuple(name for name, f in FAMILIES.items() if x86() or not f.x86)


def sources() -> list[Path]:
    """kernels.cpp and the headers it includes (all of them name the libraries)."""
    return [SOURCE, *sorted(SOURCE.parent.glob("*.h"))]


def format_names() -> list[str]:
    """The format list as kernels.cpp's ``KV_FORMATS`` has it (one object per format)."""
    text = SOURCE.read_text()
    body = re.search(r"#define KV_FORMATS\(X\)(.*?)\n\n", text, re.S)
    if body is None:
        raise RuntimeError(f"no KV_FORMATS list in {SOURCE}")
    return re.findall(r"X\((\w+),", body.group(1))


def library_name(family: str | None) -> str:
    """The dispatcher's file name (``family`` None), or a family's: a hash of the sources and
    of the flags it is compiled with."""
    flags = repr((FLAGS, LINK_FLAGS, family and FAMILIES[family]))
    data = b"".join(p.read_bytes() for p in sources())
    digest = hashlib.sha256(data + flags.encode()).hexdigest()[:12]
    return f"libkvserve_kernels-{digest}{'-' + family if family else ''}.so"


def build_dirs() -> list[Path]:
    """Where the libraries may live: beside the source (editable installs, ignored by git),
    then the user cache (read-only site-packages); ``KVSERVE_KERNEL_DIR`` names one folder
    instead (a fresh build, or a test's)."""
    env = build_environment()
    if env.kernel_dir is not None:
        return [env.kernel_dir]
    return [SOURCE.parent / "_build", env.cache_home / "kvserve" / "kernels"]


def built(family: str | None) -> Path | None:
    """The library's path if some build folder has it."""
    name = library_name(family)
    for folder in build_dirs():
        if (folder / name).is_file():
            return folder / name
    return None


Say = Callable[[str], None]


def build(family: str | None, say: Say | None = None, jobs: int | None = None) -> Path:
    """The dispatcher (``family`` None) or a family's library, compiled unless some build
    folder has it; raises ``RuntimeError`` saying what failed. ``say`` gets progress lines."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}: {', '.join(FAMILIES)}")
    found = built(family)
    if found is not None:
        return found
    compiler = build_environment().compiler or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    name = library_name(family)
    errors: list[str] = []
    for folder in build_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = open(folder / f".{name}.lock", "a")  # noqa: SIM115 (closed below)
        except OSError as e:
            errors.append(f"{folder}: {e}")
            continue
        with lock:  # closing it releases the lock
            fcntl.flock(lock, fcntl.LOCK_EX)
            target = folder / name
            if not target.is_file():  # another process may have built it while we waited
                _compile(compiler, family, target, say or (lambda _: None), jobs)
            return target
    raise RuntimeError("no writable build folder: " + "; ".join(errors))


def _objects(family: str | None) -> list[tuple[str, list[str]]]:
    """(object name, flags) of one library: the dispatcher's one object, or a family's core
    object and one per format, the K-quants (the longest: Q6_K most) first."""
    if family is None:
        return [("dispatch", [])]
    base = [f"-DKV_VARIANT={family}", *FAMILIES[family].flags]
    if not FAMILIES[family].split:
        return [(family, base)]
    names = format_names()
    k_quants = [f for f in reversed(names) if f.endswith("_K")]
    formats = [*k_quants, *(f for f in names if f not in k_quants)]
    return [
        *[(f"{family}-{f}", [*base, f"-DKV_SPLIT_FORMAT={f}"]) for f in formats],
        (f"{family}-core", [*base, "-DKV_SPLIT_CORE"]),
    ]


def _run(cmd: Sequence[str]) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed: " + " | ".join(tail))


def _compile(compiler: str, family: str | None, target: Path, say: Say, jobs: int | None) -> None:
    """The library's objects, ``jobs`` at a time (default: one per CPU), linked into a temp
    file that then replaces ``target``."""
    what = family or "dispatcher"
    objects = _objects(family)
    done = 0
    start = time.monotonic()
    stop = threading.Event()

    def progress() -> str:
        seconds = time.monotonic() - start
        return f"kvserve kernels: {what}, {done} of {len(objects)} objects, {seconds:.0f} s"

    def tick() -> None:  # the line while it compiles
        while not stop.wait(5.0):
            say(progress())

    with tempfile.TemporaryDirectory() as scratch:
        paths = [str(Path(scratch) / f"{obj}.o") for obj, _ in objects]

        def one(i: int) -> None:
            nonlocal done
            _run([compiler, *FLAGS, *objects[i][1], "-c", str(SOURCE), "-o", paths[i]])
            done += 1

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
                for result in [pool.submit(one, i) for i in range(len(objects))]:
                    result.result()
        finally:
            stop.set()
            ticker.join()
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            _run([compiler, *LINK_FLAGS, *paths, "-o", tmp])
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    say(progress() + " (done)")


def build_all(families: Sequence[str], say: Say | None = None) -> dict[str, Path | str]:
    """The dispatcher and ``families``, one after another (each compiles its objects in
    parallel): {family: its path, or why it failed}."""
    out: dict[str, Path | str] = {}
    for family in (None, *families):
        try:
            out[family or "dispatcher"] = build(family, say)
        except RuntimeError as e:
            out[family or "dispatcher"] = str(e)
    return out


def printer(stream: TextIO | None = None) -> Say:
    """Progress lines for a person: on a terminal one line rewritten in place, else one line
    each."""
    out = stream or sys.stderr
    tty = out.isatty()

    def say(line: str) -> None:
        end = "\n" if not tty or line.endswith("(done)") else ""
        print(("\r" if tty else "") + line, end=end, file=out, flush=True)

    return say
