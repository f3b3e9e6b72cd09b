"""Every module of the package, its benchmarks and examples compiles, and every module of the
package imports (a syntax error in a module no test imports went unnoticed: bench_policies)."""

from __future__ import annotations

import compileall
import importlib
import pkgutil
from pathlib import Path

import pytest

import tierstore

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("folder", ["tierstore", "policies", "benchmarks", "examples"])
def test_every_file_compiles(folder: str) -> None:
    assert compileall.compile_dir(ROOT / folder, quiet=2, force=True, legacy=False, optimize=0)


def test_every_module_of_the_package_imports() -> None:
    failed = {}
    for module in pkgutil.walk_packages(tierstore.__path__, "tierstore."):
        if module.name.endswith(".__main__"):  # (runs the command line)
            continue
        try:
            importlib.import_module(module.name)
        except ImportError as exc:  # (an optional extra not installed is not a failure of ours)
            if exc.name is not None and not exc.name.startswith("tierstore"):
                continue
            failed[module.name] = repr(exc)
        except Exception as exc:  # noqa: BLE001 - each is reported
            failed[module.name] = repr(exc)
    assert failed == {}
