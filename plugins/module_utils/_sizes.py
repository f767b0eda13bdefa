# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Byte sizes: parse operator input, render human-readable figures.

Plain Python, no Ansible import.

Accepted units (case matters, as in vLLM's ``human_readable_int``):

* none or ``B``: bytes;
* binary ``KiB`` ``MiB`` ``GiB`` ``TiB`` and vLLM's single letters ``K`` ``M`` ``G`` ``T``:
  powers of 1024;
* decimal ``kB``/``KB`` ``MB`` ``GB`` ``TB`` and vLLM's lowercase ``k`` ``m`` ``g`` ``t``:
  powers of 1000.

A fractional number is allowed only when the result is a whole number of
bytes (``"0.5GiB"`` is fine, ``"0.3B"`` is not).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

__all__ = ["MAX_BYTES", "UNITS", "SizeError", "human_bytes", "parse_size"]

# The largest size accepted: a signed 64-bit count, what vLLM and the kernel take.
MAX_BYTES = 2**63 - 1
# Longest size text and largest exponent accepted: ``"1e999999"`` would otherwise cost
# Decimal seconds of CPU before the result is found to be far too large.
_TEXT_MAX = 64
_EXPONENT_MAX = 30


class SizeError(ValueError):
    """A size value that cannot be turned into a whole, non-negative number of bytes."""


KIB = 1024
UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "KiB": KIB,
    "MiB": KIB**2,
    "GiB": KIB**3,
    "TiB": KIB**4,
    "PiB": KIB**5,
    "K": KIB,
    "M": KIB**2,
    "G": KIB**3,
    "T": KIB**4,
    "kB": 1000,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
}

_SIZE_RE = re.compile(
    r"[ \t]*(?P<num>[+-]?(?:\d[\d_]*(?:\.\d*)?|\.\d+))(?:[eE](?P<exp>[+-]?\d+))?[ \t]*(?P<unit>[A-Za-z]*)[ \t]*"
)

_BINARY_RENDER = (("PiB", KIB**5), ("TiB", KIB**4), ("GiB", KIB**3), ("MiB", KIB**2), ("KiB", KIB))
_DECIMAL_RENDER = (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000))


def _fail(field: str, value: object, why: str) -> SizeError:
    return SizeError(f"{field}: invalid size {value!r}: {why}")


def parse_size(value: object, field: str = "size") -> int:
    """Return ``value`` as a whole, non-negative number of bytes.

    ``value`` may be an ``int``, a whole-valued ``float`` or a string such as
    ``"28.25GiB"``, ``"30G"`` (binary, as vLLM), ``"30g"`` (decimal, as vLLM)
    or ``"100000000"``. Raises :class:`SizeError` (a ``ValueError``) naming
    ``field`` and the value for booleans, ``None``, negatives, unknown units
    and anything that is not a whole number of bytes.
    """
    if value is None:
        raise _fail(field, value, "a size is required")
    if isinstance(value, bool):
        raise _fail(field, value, "a boolean is not a size")
    if isinstance(value, int):
        if value < 0:
            raise _fail(field, value, "must not be negative")
        if value > MAX_BYTES:
            raise _fail(field, value, f"larger than {MAX_BYTES} (2**63 - 1)")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _fail(field, value, "not a finite number")
        if not value.is_integer():
            raise _fail(field, value, "not a whole number of bytes")
        if value < 0:
            raise _fail(field, value, "must not be negative")
        if value > MAX_BYTES:
            raise _fail(field, value, f"larger than {MAX_BYTES} (2**63 - 1)")
        return int(value)
    if not isinstance(value, str):
        raise _fail(field, value, f"expected an integer or a string, got {type(value).__name__}")
    if len(value) > _TEXT_MAX:
        raise _fail(field, value[:_TEXT_MAX] + "...", f"longer than {_TEXT_MAX} characters")
    match = _SIZE_RE.fullmatch(value)
    if not match:
        raise _fail(field, value, "expected a number with an optional unit such as 512MiB, 0.5GiB, 30G or 30g")
    unit = match.group("unit")
    if unit not in UNITS:
        raise _fail(field, value, f"unknown unit {unit!r} (use B, KiB, MiB, GiB, TiB, K, M, G, T, kB, MB, GB, TB, k, m, g, t)")
    exponent = match.group("exp")
    if exponent is not None and abs(int(exponent)) > _EXPONENT_MAX:
        raise _fail(field, value, f"exponent out of range (at most e{_EXPONENT_MAX})")
    try:
        number = Decimal(match.group("num").replace("_", "") + (f"e{exponent}" if exponent is not None else ""))
    except InvalidOperation:  # pragma: no cover - the regex only lets numbers through
        raise _fail(field, value, "not a number") from None
    if number < 0:
        raise _fail(field, value, "must not be negative")
    result = number * UNITS[unit]
    if result > MAX_BYTES:
        raise _fail(field, value, f"larger than {MAX_BYTES} (2**63 - 1)")
    if result != result.to_integral_value():
        raise _fail(field, value, "not a whole number of bytes")
    return int(result)


def _exact_decimal(n: int, unit: int) -> str:
    """Exact decimal rendering of ``n / unit`` (always finite for powers of 2 and 10)."""
    text = format(Decimal(n) / Decimal(unit), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def human_bytes(n: int, precision: int = 2, exact: bool = False) -> str:
    """Render a byte count.

    Default mode: the largest binary unit not above ``n``, rounded to
    ``precision`` decimals with trailing zeros dropped (``30333206528`` ->
    ``"28.25GiB"``, ``512`` -> ``"512B"``). Rounded figures are for people.

    Exact mode (``exact=True``): a text that :func:`parse_size` turns back
    into exactly ``n``. Candidates are every binary unit whose exact quotient
    has at most two decimals (``"28.25GiB"``, ``"1.5KiB"``), every decimal
    unit that divides ``n`` (``"100MB"``) and the plain integer; the one with
    the fewest digits wins (ties: binary, then decimal, then plain). ``parse_size(human_bytes(n,
    exact=True)) == n`` for every non-negative ``n``.

    Negative values (for instance a drift) are rendered with a leading ``-``.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise SizeError(f"human_bytes: expected an integer number of bytes, got {n!r}")
    if n < 0:
        return "-" + human_bytes(-n, precision, exact)
    if exact:
        # candidates in order of preference on a tie: binary, decimal, plain
        candidates = []
        for name, unit in _BINARY_RENDER:
            if n >= unit:
                text = _exact_decimal(n, unit)
                if len(text.partition(".")[2]) <= 2:
                    candidates.append(text + name)
        for name, unit in _DECIMAL_RENDER:
            if n >= unit and n % unit == 0:
                candidates.append(str(n // unit) + name)
        candidates.append(str(n))
        # fewest digits wins (the most readable exact form)
        return min(candidates, key=lambda c: sum(ch.isdigit() for ch in c))
    if isinstance(precision, bool) or not isinstance(precision, int) or not 0 <= precision <= 20:
        raise SizeError(f"human_bytes: precision must be an integer in 0..20, got {precision!r}")
    units = (("B", 1), *reversed(_BINARY_RENDER))
    pick = 0
    for i, (_name, unit) in enumerate(units):
        if n >= unit:
            pick = i
    name, unit = units[pick]
    text = f"{n / unit:.{precision}f}" if unit > 1 else str(n)
    if float(text) >= 1024 and pick + 1 < len(units):
        # 1023.999KiB rounds to 1024KiB: show 1MiB instead
        name, unit = units[pick + 1]
        text = f"{n / unit:.{precision}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text + name
