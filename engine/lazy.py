"""PEP 562 lazy exports: a package's public names imported on first use, not at import."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The package's `__getattr__`: `where` maps each name to the module defining it; a name
    found once is stored in `namespace` (the package's globals), so later lookups skip this."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    return __getattr__
