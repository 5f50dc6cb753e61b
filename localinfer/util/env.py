"""A setting picked from the environment among fixed values."""

from __future__ import annotations

import logging
import os


def choice(name: str, allowed: tuple[str, ...], logger: str = "localinfer") -> str:
    """``$name`` lowercased when it is one of ``allowed``; "" when unset, or (warned once per call) when it is not."""
    wanted = os.environ.get(name, "").lower()
    if wanted and wanted not in allowed:
        logging.getLogger(logger).warning("%s=%r is not one of %s; using the default", name, wanted[:40],
                                          ", ".join(allowed))
        return ""
    return wanted
