"""Swapping activations and parameters through a ``TierStore``."""

from .activations import ActivationOffload, offload_activations
from .parameters import ParameterOffload, offload_parameters, offloaded
from .report import SwapReport

__all__ = ["ActivationOffload", "ParameterOffload", "SwapReport", "offload_activations", "offload_parameters", "offloaded"]
