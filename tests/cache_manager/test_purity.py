"""cache_manager stays pure: importing it never imports torch."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_pull_torch() -> None:
    """`import cache_manager` leaves torch out of sys.modules in a fresh interpreter."""
    code = "import cache_manager, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
