"""Kept so that `from klpipe.controller import KLController, ControllerConfig` works: the controllers
live in klpipe/score/controller.py."""

from klpipe.score.controller import CONTROLLERS, ControllerConfig, KLController, KLStats

__all__ = ["CONTROLLERS", "ControllerConfig", "KLController", "KLStats"]
