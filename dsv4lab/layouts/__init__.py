"""Kernel-native weight layouts, fingerprinting and load-time repair (split into rooms in the next commit)."""
from .algebra import *  # noqa: F401,F403
from .algebra import SPEC_FORMAT, __all__, _byte_view, logical_shape  # noqa: F401
