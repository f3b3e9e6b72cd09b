"""matplotlib for the plots some commands write (``--plot``), imported only when one is asked for:
it is an optional dependency (``pip install 'tierstore[plot]'``)."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` with the non-interactive Agg backend, or a clear error without it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'tierstore[plot]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
