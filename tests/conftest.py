from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def device_mode(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Under ``@pytest.mark.device_modes`` (module or test), each test runs twice: on the plain
    CPU (device memory is host memory, lent) and on the emulated device
    (``tierstore.device.emulate_device()``: every crossing is a real copy over a link)."""
    mode = getattr(request, "param", None)
    if mode is None:
        yield None
        return
    from tierstore.device import emulate_device

    with emulate_device(mode == "emulated"):
        yield mode


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("device_modes") is not None and "device_mode" in metafunc.fixturenames:
        metafunc.parametrize("device_mode", ["plain", "emulated"], indirect=True)


@contextlib.contextmanager
def _before_catalog_commits(check: Callable[[Sequence[tuple[str, Any]]], None]) -> Iterator[None]:
    """Run ``check(changes)`` on the writing thread before each catalog transaction (it may
    wait, or raise to fail the whole transaction, as LMDB would)."""
    from tierstore.disk.catalog import Catalog

    real = Catalog._write_sync

    def write(self: Catalog, changes: Sequence[tuple[str, Any]], layout: Any) -> None:
        check(changes)
        real(self, changes, layout)

    Catalog._write_sync = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        Catalog._write_sync = real  # type: ignore[method-assign]


def _disk_full() -> BaseException:
    from tierstore.errors import DiskFullError

    return DiskFullError(28, "no space left on device (injected)")


@pytest.fixture
def full_for() -> Iterator[set[str]]:
    """Keys whose catalog transactions fail as on a full disk (the whole transaction, as LMDB
    would), while they are in the set."""
    keys: set[str] = set()

    def check(changes: Sequence[tuple[str, Any]]) -> None:
        if any(key in keys for key, _ in changes):
            raise _disk_full()

    with _before_catalog_commits(check):
        yield keys


@pytest.fixture
def commit_gate() -> Iterator[threading.Event]:
    """Catalog transactions of keys starting with ``slow`` wait while the event is clear (it
    starts set); those of keys starting with ``fail`` raise as on a full disk."""
    event = threading.Event()
    event.set()

    def check(changes: Sequence[tuple[str, Any]]) -> None:
        if any(key.startswith(("slow", "fail")) for key, _ in changes):
            assert event.wait(10), "the test never opened the gate"
        if any(key.startswith("fail") for key, _ in changes):
            raise _disk_full()

    try:
        with _before_catalog_commits(check):
            yield event
    finally:
        event.set()


@pytest.fixture
def counters() -> None:
    """Skip where this process's block-I/O counters (``tierstore.testing.block_io``) cannot be read."""
    from tierstore.testing import block_io

    try:
        block_io()
    except (OSError, KeyError, ValueError) as exc:
        pytest.skip(f"/proc/self/io cannot be read: {exc}")


@pytest.fixture
def swap_store() -> Iterator[Any]:
    """A store for swapping tests: a 64 MiB device tier on the CPU (the emulated device's, in
    ``device_mode`` "emulated") above a 256 MiB host tier."""
    from tierstore import DeviceTier, HostTier, SyncTierStore

    store = SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("256MiB")]).open()
    yield store
    store.close()


@pytest.fixture(scope="module")
def store_trace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The arrays of a store's trace (tiers host and disk, six keys put and read), for the
    simulator's tests to edit."""
    import numpy as np

    from tierstore import DiskTier, HostTier, SyncTierStore

    folder = tmp_path_factory.mktemp("store_trace")
    out = folder / "t.npz"
    with SyncTierStore([HostTier("16KiB"), DiskTier(folder / "disk", "1MiB")], trace=out) as store:
        for i in range(6):
            store.put(f"k{i}", torch.zeros(1024, dtype=torch.uint8))
            store.get(f"k{i}")
    with np.load(out) as archive:
        return {name: archive[name] for name in archive.files}
