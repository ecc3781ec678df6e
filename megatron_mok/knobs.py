"""The MOK_* environment knobs (A/B switches of the kernel backend, docs/knobs.md), read
and validated once: at import, and again only when `reload()` is called (tests and
benchmarks that switch a knob mid-process). The C++ launchers get their knobs from here
(`set_knobs` op, pushed by kernels.ops through `on_reload`) instead of reading the environment per launch, so a bad value is the
same clear ValueError on both sides, raised before any kernel runs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional


def _multiple_of_128(value: str) -> bool:
    return value.isdigit() and int(value) >= 128 and int(value) % 128 == 0


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    default: Optional[str]   # None: unset means "no override" (e.g. the autotuned plan)
    choices: tuple = ()      # the accepted values, or
    check: Optional[Callable[[str], bool]] = None  # a validator with `rule` saying what it wants
    rule: str = ""


KNOBS = {k.name: k for k in (
    Knob("MOK_FORWARD", None, ("launches", "megakernel", "megakernel-comm",
                               "megakernel-spread")),
    Knob("MOK_BACKWARD", None, ("launches", "megakernel")),
    Knob("MOK_BACKWARD_MINIBATCH", "2048", check=_multiple_of_128,
         rule="a positive multiple of 128"),
    Knob("MOK_BACKWARD_WGRAD", "launches", ("fused", "launches")),
    Knob("MOK_SCHEDULE", "kernel", ("torch", "kernel")),
    Knob("MOK_SHARED_EXPERT", "separate", ("separate", "folded")),
    Knob("MOK_EP1_COMBINE", "rows", ("slots", "rows")),
    Knob("MOK_GEMM_CORE", "mok", ("mok", "torch")),
    Knob("MOK_FP8_KERNELS", "0", ("0", "1")),
    Knob("MOK_WGRAD_GATHER", "0", ("0", "1")),
    Knob("MOK_FP8_FUSED_QUANT", "0", ("0", "1")),
    Knob("MOK_AUTOTUNE_CACHE", None, check=lambda v: bool(v), rule="a file path"),
    # Read by the C++ launchers (through set_knobs).
    Knob("MOK_GEMM_SCHEDULER", "counter", ("counter", "static")),
    Knob("MOK_GEMM_CLUSTER", "1", ("1", "2")),
    Knob("MOK_GEMM_PINGPONG", "0", ("0", "1")),
    Knob("MOK_DGRAD_H", "ring", ("ring", "global")),
    Knob("MOK_MEGAKERNEL_GATHER", "lines", ("lines", "tma", "rows")),
    Knob("MOK_MOVER_WARPS", "8", ("1", "2", "4", "8")),
    Knob("MOK_FP8_PROMOTION", "serial", ("serial", "overlap")),
)}

# The knobs that change which plan the autotuner measures (part of its cache key).
PLAN_KNOBS = ("MOK_GEMM_SCHEDULER", "MOK_GEMM_CLUSTER", "MOK_GEMM_PINGPONG", "MOK_DGRAD_H",
              "MOK_MEGAKERNEL_GATHER", "MOK_MOVER_WARPS", "MOK_EP1_COMBINE", "MOK_SCHEDULE",
              "MOK_GEMM_CORE")


def _read(environ) -> dict:
    values = {}
    for knob in KNOBS.values():
        raw = environ.get(knob.name)
        if raw is None:
            values[knob.name] = knob.default
            continue
        ok = raw in knob.choices if knob.choices else knob.check(raw)
        if not ok:
            wanted = " or ".join(knob.choices) if knob.choices else knob.rule
            raise ValueError(f"megatron_mok: {knob.name} must be {wanted}, got {raw!r}")
        values[knob.name] = raw
    return values


_VALUES: dict = {}  # name -> value, as read at import / the last reload


def get(name: str) -> Optional[str]:
    """The value of knob `name` as read at import / the last reload (None: unset, no
    default)."""
    return _VALUES[name]


_SET: dict = {}


def is_set(name: str) -> bool:
    """Whether the environment set knob `name` (rather than leaving its default)."""
    return _SET[name]


def reload(environ=None) -> None:
    """Read every knob again (os.environ by default), validate all of them first, then
    hand the C++ launchers theirs."""
    environ = os.environ if environ is None else environ
    values = _read(environ)
    _VALUES.clear()
    _VALUES.update(values)
    _SET.clear()
    _SET.update({name: name in environ for name in KNOBS})
    _push_to_extension()


def plan_signature() -> str:
    """The knobs that change a measured plan, for the autotune cache key (defaults
    left out, so default plans keep their old keys)."""
    return ",".join(f"{n}={_VALUES[n]}" for n in PLAN_KNOBS if _VALUES[n] != KNOBS[n].default)


_LISTENERS: list = []


def on_reload(listener: Callable[[dict], None]) -> None:
    """Call `listener(values)` now and after every reload: how the extension's loader
    (kernels.ops) hands the C++ launchers their knobs without this module importing it."""
    _LISTENERS.append(listener)
    listener(dict(_VALUES))


def _push_to_extension() -> None:
    for listener in _LISTENERS:
        listener(dict(_VALUES))


reload()


def set_env(name: str, value: Optional[str]) -> None:
    """Set (or, with None, unset) knob `name` in os.environ and read the knobs again (for
    scripts that A/B a knob within one process)."""
    if name not in KNOBS:
        raise KeyError(f"megatron_mok: no knob named {name}")
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    reload()
