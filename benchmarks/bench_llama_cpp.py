"""llama.cpp's ``llama-server``, built from a PyPI source package and measured side by side.

    python -m benchmarks.bench_llama_cpp            # build once (or find the cached build)
    python -m benchmarks.bench_llama_cpp --print    # only say where the cached binary is

Build (once per version; ``make bench`` does it when the binary is missing):

1. ``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36``: the sdist vendors
   llama.cpp (``vendor/llama.cpp``, with ``tools/server``). PyPI is the only source used.
2. Unpack ``vendor/llama.cpp`` into ``<cache>/src`` and build ``TARGETS`` (``llama-server``,
   ``llama-quantize``, ``llama-bench``)
   with CMake (Ninja when found; CMake and Ninja from a private build venv when the machine has
   no ``cmake``): Release, ``-DGGML_NATIVE=ON``, static, OpenMP, and nothing that downloads
   (no prebuilt web UI, no curl, no OpenSSL).
3. Copy the binaries to ``<cache>/bin/``. ``<cache>`` is
   ``$KVSERVE_CACHE_DIR/llama.cpp/<version>`` (default ``~/.cache/kvserve/llama.cpp/<version>``),
   outside the repository; ``<cache>/build.log`` keeps the build's output.

Up to an hour on 2 cores (56 min on a busy one), once. A later ``make bench`` finds the binary
and builds nothing.

Measurement (``measure``): a fresh ``llama-server`` per configuration on the same GGUF that
kvserve serves (the embedded SmolLM2 Q4_1), ``--threads`` / ``--threads-batch`` as kvserve's
torch threads, flash attention on (``-fa on``), continuous batching (``-cb``) with 32 slots of
512 tokens each (``-np 32 -c 16384``), llama.cpp's defaults otherwise (prompt caching included,
as kvserve's prefix caching is on by default). The same warm-up and the same load generator as
kvserve's, through ``kvserve loadtest --api openai`` (``LoadConfig(api="openai")``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from loadtest.launch import ChildServer

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendor/llama.cpp we build
SLOTS = 32
# What one build makes: the server (chat128 peer), llama-quantize (the Q4_K_M files of the
# `models` section), llama-bench (pp512 / tg128) and test-backend-ops (ggml's MUL_MAT op
# timings, the `kernels` section's peer).
TARGETS = ("llama-server", "llama-quantize", "llama-bench", "test-backend-ops")
CTX_PER_SLOT = 512  # chat128 needs 256 (128 prompt + 128 output)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=ON",  # for the test-backend-ops target alone
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    # Nothing that downloads: no prebuilt web UI (fetched at build time), no curl, no OpenSSL.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
)

Say = Callable[[str], None]


class LlamaCppUnavailable(RuntimeError):
    """No llama-server to measure; the message is the reason the table prints."""


def default_cache_dir(env: Mapping[str, str], version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``$KVSERVE_CACHE_DIR/llama.cpp/<version>``, else ``~/.cache/kvserve/llama.cpp/<version>``."""
    root = env.get("KVSERVE_CACHE_DIR") or str(Path.home() / ".cache" / "kvserve")
    return Path(root) / "llama.cpp" / version


def binary_path(cache_dir: Path) -> Path:
    return cache_dir / "bin" / "llama-server"


def cached_binary(cache_dir: Path) -> Path | None:
    """The cached ``llama-server`` if it is there and runs (``--version`` exits 0)."""
    path = binary_path(cache_dir)
    if not path.is_file():
        return None
    try:
        done = subprocess.run(
            [str(path), "--version"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if done.returncode == 0 else None


def binary_version(binary: Path) -> str:
    """The first line of ``llama-server --version`` (``version: N (commit)``), or ""."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[0].removeprefix("version:").strip() if lines else ""


def ensure_binary(
    cache_dir: Path,
    *,
    build: bool = True,
    version: str = LLAMA_CPP_PYTHON_VERSION,
    jobs: int | None = None,
    say: Say = print,
) -> Path:
    """The cached binary, built first when missing and ``build``; else ``LlamaCppUnavailable``."""
    found = cached_binary(cache_dir)
    if found is not None:
        return found
    if not build:
        raise LlamaCppUnavailable(f"no cached build at {binary_path(cache_dir)}")
    return build_binary(cache_dir, version=version, jobs=jobs, say=say)


def ensure_tools(cache_dir: Path, *, build: bool = True, say: Say = print) -> dict[str, Path]:
    """Every ``TARGETS`` binary in the cache, building the missing ones when ``build`` (a
    cache from before llama-quantize and llama-bench were built rebuilds only those); the
    ones that could not be had are left out."""
    tools = {name: cache_dir / "bin" / name for name in TARGETS}
    if build and not all(path.is_file() for path in tools.values()):
        try:
            build_binary(cache_dir, say=say)
        except LlamaCppUnavailable as e:
            say(f"[llama.cpp] tools not built: {e}")
    return {name: path for name, path in tools.items() if path.is_file()}


def build_binary(
    cache_dir: Path,
    *,
    version: str = LLAMA_CPP_PYTHON_VERSION,
    jobs: int | None = None,
    say: Say = print,
) -> Path:
    """Download the sdist, unpack its llama.cpp and build ``llama-server`` into ``cache_dir``.

    Reuses what an earlier, interrupted build left (``src/``, ``build/``): CMake and Ninja
    rebuild only what is missing. Raises ``LlamaCppUnavailable`` saying which step failed.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    log_path = cache_dir / "build.log"
    src = cache_dir / "src"
    with log_path.open("ab") as log:
        if not (src / "CMakeLists.txt").is_file():
            say(f"[llama.cpp] downloading llama-cpp-python=={version} (sdist) from PyPI")
            _unpack_sdist(cache_dir, version, src, log)
        cmake, ninja = _build_tools(cache_dir, log, say)
        build_dir = cache_dir / "build"
        generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
        if (build_dir / "CMakeCache.txt").is_file():
            generator = []  # keep the generator an earlier configure chose
        jobs = jobs or os.cpu_count() or 2
        say(
            f"[llama.cpp] building llama-server ({jobs} jobs, once; up to an hour on 2 cores); "
            f"log: {log_path}"
        )
        _run([cmake, "-S", str(src), "-B", str(build_dir), *generator, *CMAKE_FLAGS], log,
             "cmake configure", log_path)  # fmt: skip
        _run([cmake, "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs)],
             log, "cmake build", log_path, nice=True)  # fmt: skip
    # llama-server last: its presence is what marks the cache complete.
    for name in sorted(TARGETS, key=lambda t: t == "llama-server"):
        built = build_dir / "bin" / name
        if not built.is_file():
            raise LlamaCppUnavailable(f"the build made no {built} (log: {log_path})")
        target = cache_dir / "bin" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        shutil.copy2(built, tmp)
        tmp.replace(target)
    target = binary_path(cache_dir)
    found = cached_binary(cache_dir)
    if found is None:
        raise LlamaCppUnavailable(f"{target} was built but does not run (log: {log_path})")
    say(f"[llama.cpp] built {target}")
    return found


def _unpack_sdist(cache_dir: Path, version: str, src: Path, log: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="llama-sdist-", dir=cache_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", tmp]  # fmt: skip
        _run(cmd, log, "pip download of the llama-cpp-python sdist", cache_dir / "build.log")
        archives = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise LlamaCppUnavailable(f"pip download left no llama_cpp_python-*.tar.gz in {tmp}")
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        unpack = Path(tmp) / "unpacked"
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise LlamaCppUnavailable(f"{archives[0].name} vendors no llama.cpp ({prefix})")
            tar.extractall(unpack, members=members, filter="data")
        if src.exists():
            shutil.rmtree(src)
        shutil.move(str(unpack / prefix), str(src))


def _build_tools(cache_dir: Path, log: Any, say: Say) -> tuple[str, str | None]:
    """(cmake, ninja or None): the machine's, else from a private venv under ``cache_dir``."""
    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if cmake:
        return cmake, ninja
    venv = cache_dir / "build-venv"
    tools = venv / "bin"
    if not (tools / "cmake").is_file():
        say(f"[llama.cpp] no cmake on PATH: installing cmake and ninja into {venv}")
        _run([sys.executable, "-m", "venv", str(venv)], log, "venv", cache_dir / "build.log")
        _run([str(tools / "python"), "-m", "pip", "install", "--quiet", "cmake", "ninja"], log,
             "pip install cmake ninja", cache_dir / "build.log")  # fmt: skip
    return str(tools / "cmake"), str(tools / "ninja") if (tools / "ninja").is_file() else None


def _run(cmd: Sequence[str], log: Any, what: str, log_path: Path, nice: bool = False) -> None:
    log.write(f"\n$ {' '.join(cmd)}\n".encode())
    log.flush()
    try:
        done = subprocess.run(
            list(cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
            preexec_fn=(lambda: os.nice(10)) if nice else None,
        )
    except OSError as e:
        raise LlamaCppUnavailable(f"{what} could not start: {e}") from None
    if done.returncode != 0:
        raise LlamaCppUnavailable(f"{what} failed (exit {done.returncode}; log: {log_path})")


# ------------------------------------------------------------------------------ server


def server_args(
    model: Path,
    port: int,
    threads: int,
    *,
    slots: int = SLOTS,
    ctx_per_slot: int = CTX_PER_SLOT,
    extra: Sequence[str] = (),
) -> list[str]:
    """The measured configuration (see the module docstring); ``extra`` flags go last."""
    return [
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--threads", str(threads), "--threads-batch", str(threads),
        "--flash-attn", "on", "--cont-batching",
        "--parallel", str(slots), "--ctx-size", str(slots * ctx_per_slot),
        "--no-webui", *extra,
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer(ChildServer):
    """A ``llama-server`` child on 127.0.0.1; a context manager (``target`` is its base URL)."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        threads: int,
        startup_timeout_s: float = 300.0,
        *,
        slots: int = SLOTS,
        ctx_per_slot: int = CTX_PER_SLOT,
        extra: Sequence[str] = (),
    ) -> None:
        self.binary = binary
        self.model = model
        self.threads = threads
        self.startup_timeout_s = startup_timeout_s
        self.slots = slots
        self.ctx_per_slot = ctx_per_slot
        self.extra = tuple(extra)
        self.port = 0
        self.args: list[str] = []
        self.metrics_url: str | None = None
        super().__init__("llama-server-")

    @property
    def target(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self.port = _free_port()
        self.args = server_args(
            self.model,
            self.port,
            self.threads,
            slots=self.slots,
            ctx_per_slot=self.ctx_per_slot,
            extra=self.extra,
        )
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), *self.args], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {self.proc.returncode} before serving:\n"
                    f"{self.log()[-4000:]}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"llama-server not healthy within {self.startup_timeout_s:g}s")
            time.sleep(0.1)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.target}/health", timeout=2) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def measure(
    binary: Path,
    model: Path,
    workload: Any,
    *,
    threads: int,
    users: int,
    num_requests: int,
    duration_s: float,
    desc: str,
    progress: bool = True,
) -> dict[str, Any]:
    """Fresh llama-server, the same warm-up as kvserve's, then one closed-loop run; its report."""
    from benchmarks.bench_serving import warm_and_run

    with LlamaServer(binary, model, threads) as server:
        report = warm_and_run(
            server,
            workload,
            api="openai",
            users=users,
            num_requests=num_requests,
            duration_s=duration_s,
            desc=desc,
            progress=progress,
        )
        report["server_args"] = server.args[:]
        return report


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    """llama.cpp in this run: a binary to measure, or the reason it is not measured."""

    binary: Path | None
    reason: str = ""
    version: str = ""


def find_llama_cpp(mode: str, cache_dir: Path, say: Say = print) -> LlamaCpp:
    """``build``: the cached binary, built first when missing; ``cached``: only a cached one;
    ``off``: none. Never raises: a failure becomes the reason the table prints."""
    if mode == "off":
        return LlamaCpp(None, "--llama-cpp off")
    try:
        binary = ensure_binary(cache_dir, build=mode == "build", say=say)
    except LlamaCppUnavailable as e:
        return LlamaCpp(None, str(e))
    return LlamaCpp(binary, version=binary_version(binary))


def llama_cpp_note(llama_cpp: LlamaCpp, threads: int) -> str:
    """The line under the table saying what the llama.cpp columns are."""
    if llama_cpp.binary is None:
        return f"llama.cpp: not measured in this run ({llama_cpp.reason})."
    return (
        f"llama.cpp = llama-server {llama_cpp.version or '(version unknown)'}, built from the "
        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist ({llama_cpp.binary}); same GGUF, "
        f"{threads} threads, -fa on, continuous batching, {SLOTS} slots x {CTX_PER_SLOT} tokens; "
        "the same requests through the same load generator (kvserve loadtest --api openai), "
        "measured right after kvserve at each level of this run."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_llama_cpp", description=__doc__.splitlines()[0]
    )
    p.add_argument("--cache-dir", type=Path, default=None, help="default: see the docstring")
    p.add_argument("--jobs", type=int, default=None, help="build jobs (default: CPU count)")
    p.add_argument("--print", action="store_true", help="only print the cached binary's path")
    args = p.parse_args(argv)
    cache_dir = args.cache_dir or default_cache_dir(os.environ)
    try:
        path = ensure_binary(cache_dir, build=not args.print, jobs=args.jobs)
    except LlamaCppUnavailable as e:
        print(f"llama.cpp not available: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
