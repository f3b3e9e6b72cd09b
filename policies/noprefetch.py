"""NoPrefetch: never suggests anything (every miss is a demand miss)."""

from __future__ import annotations

from collections.abc import Iterable


class NoPrefetch:
    """The prefetch policy that does nothing."""

    name = "none"

    def on_access(self, key: str, nbytes: int, tier: str, hit: bool) -> None:
        pass

    def on_step(self) -> None:
        pass

    def suggest(self) -> Iterable[tuple[str, str | None]]:
        return ()

    def reset(self) -> None:
        pass
