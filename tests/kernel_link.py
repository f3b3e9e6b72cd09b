"""An emulated link whose "kernels" end only when the test says so, for the tests of buffers
given back after the kernels that last used them (``Engine._release_after``)."""

from __future__ import annotations

import threading
from typing import Any

from tierstore.device.emulated import EmulatedLink
from tierstore.device.transfer import Transfer


class KernelLink(EmulatedLink):
    """An emulated link on which the caller's "kernels" queued while ``launching`` is set run
    until ``finish()``: a ``mark()`` then is a ``Transfer`` that ends only then (as a CUDA event
    after a slow kernel; never, if ``finish()`` is not called)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = Transfer("marker", 0)
        self.launching = False

    def mark(self) -> Any:
        return self.kernels if self.launching else super().mark()

    def when_done(self, marker: Any) -> Transfer:
        return marker if isinstance(marker, Transfer) else super().when_done(marker)

    def finish(self) -> None:
        """The kernels end, on another thread (as a CUDA event waiter's)."""
        thread = threading.Thread(target=self.kernels.finish)
        thread.start()
        thread.join()
