"""Numbers printed in the direction of their claim (Note [printed bounds], THEORY F106).

Note [printed bounds]: a certified upper bound printed to nearest with 5 digits can print *below* the value it
certifies (5.972362725… as ``5.9724`` is fine, 5.972362725… as ``5.97236`` is not: red team 169 counted 885 such cells in
one MiniLM report, and a B_KQ interval's printed upper end below its own lower end).  Every table and page prints an
upper bound rounded toward +inf, a lower bound (an interval's lower end, an attained value) toward -inf, and an
estimate to nearest.  The rounding is done on the float's exact decimal expansion (``decimal.Decimal(x)`` is exact), so
the printed digits are the closest ones on the side of the claim, with no float arithmetic in between.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext

# digits enough for any float64 written out in full (1e308 has 309 integer digits, a subnormal 767 significant ones)
_PREC = 2000

__all__ = ["up", "down", "near", "directed", "log10_up", "for_kind", "from_ln", "fixed", "count_up", "count_exact"]


def directed(x: float, digits: int, way: str) -> str:
    """``x`` to ``digits`` significant digits in ``%g`` style, rounded ``way`` = "up" (toward +inf), "down" (toward
    -inf) or "near" (to nearest).  Non-finite values and 0 are printed as they are."""
    if way not in ("up", "down", "near"):
        raise ValueError(f"way must be 'up', 'down' or 'near', but got way={way!r}")
    x = float(x)
    if way == "near" or x == 0.0 or not math.isfinite(x):
        return f"{x:.{digits}g}"
    d = Decimal(x)
    q = Decimal(1).scaleb(d.adjusted() - digits + 1)  # the unit of the last kept digit
    with localcontext(prec=_PREC):
        r = d.quantize(q, rounding=ROUND_CEILING if way == "up" else ROUND_FLOOR)
    return _as_float_g(r, digits)


def _as_float_g(r: Decimal, digits: int) -> str:
    """The decimal ``r`` (at most ``digits`` significant digits, or one more trailing zero after a carry such as
    9.99995 -> 10.0000) spelled as float's ``%.{digits}g``: exponent form below 1e-4 or from 10^digits, trailing
    zeros dropped, a two-digit signed exponent (Decimal's own ``g`` switches at other exponents)."""
    sign, ds, exp = r.normalize().as_tuple()
    text = "".join(map(str, ds)).rstrip("0") or "0"
    adj = r.adjusted()
    neg = "-" if sign else ""
    if -4 <= adj < digits:  # positional
        point = adj + 1
        if point <= 0:
            return f"{neg}0.{'0' * -point}{text}"
        whole, frac = (text + "0" * max(0, point - len(text)))[:point], text[point:]
        return f"{neg}{whole}.{frac}" if frac else f"{neg}{whole}"
    return f"{neg}{text[0]}{'.' + text[1:] if len(text) > 1 else ''}e{adj:+03d}"


def up(x: float, digits: int = 5) -> str:
    """An upper bound as printed: never below ``x``."""
    return directed(x, digits, "up")


def down(x: float, digits: int = 5) -> str:
    """A lower bound as printed: never above ``x``."""
    return directed(x, digits, "down")


def near(x: float, digits: int = 5) -> str:
    """An estimate (or an exact value) to nearest."""
    return directed(x, digits, "near")


def count_up(n: float, digits: int = 3) -> str:
    """A sample size that meets a target, printed: the whole number ``ceil(n)`` rounded up to ``digits`` significant
    digits (a rounded-down n may not meet the target, a fractional one is no sample size)."""
    return up(math.ceil(n), digits) if math.isfinite(n) else f"{n}"


def count_exact(n: float) -> str:
    """A sample size as given, printed exactly: a whole number below 10^16 with thousands separators (110,384,404;
    ``%.3g`` showed 1.1e+08 beside a gap certified at that exact n: red team 215), any other the shortest decimal
    that reads back to the same float (1e+300)."""
    n = float(n)
    return f"{int(n):,}" if math.isfinite(n) and n == int(n) and abs(n) < 1e16 else repr(n)


def log10_up(ln_value: float, digits: int = 4, *, decimals: int | None = None) -> str:
    """``log10`` of a number given by its natural log, as an upper bound: ``ln_value / ln 10`` padded for the
    division's rounding (a relative 4u plus the smallest subnormal), then rounded up to ``digits`` significant digits,
    or to ``decimals`` decimals where given."""
    v = ln_value / math.log(10)
    if not math.isfinite(v):
        return f"{v}"
    v = v + abs(v) * 4 * 2.0 ** -53 + 2.0 ** -1074
    return up(v, digits) if decimals is None else fixed(v, decimals, "up")


def for_kind(x: float, kind: object, digits: int = 4) -> str:
    """``x`` rounded the way its ``Kind`` claims: a certified upper bound (or an interval's upper end) up, a lower
    bound (certified or attained) down, an estimate or an exact value to nearest."""
    k = str(getattr(kind, "value", kind))
    way = "up" if k in ("certified upper bound", "certified interval") else ("down" if "lower" in k else "near")
    return directed(x, digits, way)


def from_ln(ln_value: float, way: str = "up") -> str:
    """A number given by its natural log, as a float below 1e6 and as 10^x above, rounded ``way`` (the numbers
    printed this way are mostly upper bounds, hence the default; "near" for a chosen value such as an eps_i)."""
    if ln_value == -math.inf:
        return "0"
    if ln_value < math.log(1e6):
        v = math.exp(ln_value)
        pad = {"up": 1 + 4 * 2.0 ** -53, "down": 1 - 4 * 2.0 ** -53}.get(way, 1.0)  # exp's own rounding
        return directed(v * pad, 4, way)
    if way == "up":
        return f"10^{log10_up(ln_value, decimals=2)}"
    if way == "down":
        v = ln_value / math.log(10)
        v = v - abs(v) * 4 * 2.0 ** -53 - 2.0 ** -1074
        return f"10^{fixed(v, 2, 'down')}"
    return f"10^{ln_value / math.log(10):.2f}"


def fixed(x: float, decimals: int, way: str) -> str:
    """``x`` with ``decimals`` decimals (``%f`` style), rounded ``way`` as :func:`directed`."""
    if way not in ("up", "down", "near"):
        raise ValueError(f"way must be 'up', 'down' or 'near', but got way={way!r}")
    x = float(x)
    if way == "near" or not math.isfinite(x):
        return f"{x:.{decimals}f}"
    with localcontext(prec=_PREC):
        r = Decimal(x).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_CEILING if way == "up" else ROUND_FLOOR)
    return f"{r:.{decimals}f}"
