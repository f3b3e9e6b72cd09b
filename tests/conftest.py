from __future__ import annotations

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
