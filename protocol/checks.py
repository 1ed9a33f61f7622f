"""Check the settings a service is configured with: each error names the setting and the value it was given."""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any


def check_int(name: str, value: Any, lo: int, hi: int | None = None, none: bool = False) -> None:
    """ValueError unless `value` is an integer (not a bool) in [lo, hi] (None too, with `none`)."""
    if value is None and none:
        return
    try:
        v = operator.index(value)
    except TypeError:
        v = None
    if v is None or type(value) is bool or v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={value!r} must be an integer {bound}{' or None' if none else ''}")


def check_seconds(name: str, value: Any, positive: bool = True) -> None:
    """ValueError unless `value` is a finite number of seconds, > 0 (or >= 0 without `positive`)."""
    ok = (isinstance(value, (int, float)) and type(value) is not bool and math.isfinite(value)
          and (value > 0 if positive else value >= 0))
    if not ok:
        raise ValueError(f"{name}={value!r} must be a finite number of seconds {'> 0' if positive else '>= 0'}")



def resolved_config(cls: type, config: Any, settings: dict) -> Any:
    """A service's settings: `config` (an instance of the frozen dataclass `cls`) with `settings` replacing its
    fields, or, without a config, `cls(**settings)`: what Producer, Broker and Consumer take."""
    if config is None:
        return cls(**settings)
    return dataclasses.replace(config, **settings) if settings else config
