"""cache_manager stays pure: importing it never imports torch."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_pull_torch() -> None:
    """`import cache_manager` leaves torch out of sys.modules in a fresh interpreter."""
    code = "import cache_manager, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tier_bookkeeping_does_no_io() -> None:
    """cache_manager (tier 2 included) imports no file, database or thread module."""
    code = (
        "import sys, cache_manager, cache_manager.tier\n"
        "bad = {'lmdb', 'kv_store', 'threading', 'sqlite3'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
