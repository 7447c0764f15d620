"""A package's names imported from their modules on first use (PEP 562's module `__getattr__`).

A package that re-exports its modules' names imports every module when anything under it is
imported: `rollouts worker`, which only starts a worker process, paid for the Python API and the
producer's whole run path (about 1 s on a 2-core machine). A package lists its names here instead,
and imports them for type checkers only (`if TYPE_CHECKING:`); `from package import name` and
`package.name` work as before.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["exports"]


def exports(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of `package`: each of `names` (name -> module) imported from its module
    when first asked for, then kept on the package."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
