"""matplotlib is optional (``tierstore[plot]``): a plot asked for without it says how to get it."""

from __future__ import annotations

import sys

import pytest

from tierstore.plotting import pyplot


def test_a_plot_without_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"tierstore\[plot\]"):
        pyplot()


def test_with_matplotlib_it_is_pyplot_on_agg() -> None:
    pytest.importorskip("matplotlib")
    plt = pyplot()
    assert plt.get_backend().lower() == "agg"
