"""The run-time switches of the CPU kernels (environment variables read by the C++ code, most
of them per call): which values each one reads, and a warning at import for a value it does not
read or a switch name it does not know (both used to be ignored without a word: e.g.
``ATTN_EXT_CPU_DECODE=off`` left the decode kernel on)."""

from __future__ import annotations

import os
import warnings
from typing import Dict, Mapping, Optional, Tuple

_ON_OFF = ("0", "1")  # 0: off; 1: on, as unset (the default)
# name -> the values the kernels read (any other value, like an unset switch, keeps the default;
# ATTN_EXT_CPU_BF16DP=1 forces the pairs where the rule would widen, README)
SWITCHES: Dict[str, Tuple[str, ...]] = {
    "ATTN_EXT_CPU_SIMD": _ON_OFF,
    "ATTN_EXT_CPU_AVX512": _ON_OFF,
    "ATTN_EXT_CPU_AMX": _ON_OFF,
    "ATTN_EXT_CPU_BF16DP": _ON_OFF,
    "ATTN_EXT_CPU_GEMM512": _ON_OFF,
    "ATTN_EXT_CPU_DECODE": _ON_OFF,
    "ATTN_EXT_CPU_DECODE_HEAD_SPLIT": _ON_OFF,
    "ATTN_EXT_CPU_DECODE_IN_PLACE": _ON_OFF,
    "ATTN_EXT_CPU_DECODE_PV512": _ON_OFF,
    "ATTN_EXT_CPU_DECODE_PV_PAIRS": _ON_OFF,
    "ATTN_EXT_CPU_DECODE_QUADS": _ON_OFF,
    "ATTN_EXT_CPU_DECODE_SCORES512": _ON_OFF,
    "ATTN_EXT_CPU_DP_TILE16": _ON_OFF,
    "ATTN_EXT_CPU_BWD_JOBS": ("1", "2", "3", "4"),
}


def check_switches(environ: Optional[Mapping[str, str]] = None) -> list:
    """Warns (UserWarning) for each ATTN_EXT_CPU_* variable whose name is not a switch or whose
    value the kernels do not read; returns the messages."""
    environ = os.environ if environ is None else environ
    messages = []
    for name in sorted(environ):
        if not name.startswith("ATTN_EXT_CPU_"):
            continue
        value = environ[name]
        if name not in SWITCHES:
            messages.append(f"{name} is not a switch attn_ext reads (its CPU switches: "
                            f"{', '.join(SWITCHES)}); it has no effect")
        elif value not in SWITCHES[name]:
            messages.append(f"{name}={value!r} is not a value attn_ext reads (it reads "
                            f"{' or '.join(repr(v) for v in SWITCHES[name])}); the default is kept")
    for m in messages:
        warnings.warn(m, stacklevel=3)
    return messages
