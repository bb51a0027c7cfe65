"""`jzo.ZeroEngine`: the object users hold; it drives each step."""

from jzo.engine.engine import ZeroEngine

__all__ = ["ZeroEngine"]
