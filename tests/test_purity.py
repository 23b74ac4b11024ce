"""The pure core stays pure: scheduler/ and cache_manager/ never import torch (one test for
both packages, every module of each)."""

import subprocess
import sys


def test_core_packages_do_not_import_torch() -> None:
    """Importing every scheduler and cache_manager module leaves torch out of sys.modules."""
    code = (
        "import importlib, pkgutil, sys\n"
        "for pkg in ('cache_manager', 'scheduler'):\n"
        "    mod = importlib.import_module(pkg)\n"
        "    for info in pkgutil.walk_packages(mod.__path__, pkg + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "for name in ('base', 'fake', 'sim', 'step'):\n"
        "    name = 'model_runner.' + name\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if e.name != name: raise\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tier_bookkeeping_does_no_io() -> None:
    """cache_manager (tier 2 included) imports no file, database or thread module."""
    code = (
        "import sys, cache_manager, cache_manager.tier\n"
        "bad = {'lmdb', 'kv_store', 'threading', 'sqlite3'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
