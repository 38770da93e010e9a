"""Sizes in bytes written as text: '5GB', '500 MB', '1.5GiB' or a plain number."""

from __future__ import annotations

from bigtrain.errors import ConfigError

UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(value: str | int, key: str, unit_required: bool = False) -> int:
    """Bytes from '80GiB', '80 GB', '81920MiB', '1.5GiB' or a plain number of bytes (decimal
    units are powers of 10, binary ones powers of 2). `key` names the option in the error
    message. `unit_required`: a plain number is an error too (where it is never meant as bytes
    and GB and GiB, 7% apart, both are in use)."""
    t = str(value).strip().upper().replace(" ", "")
    if unit_required and not isinstance(value, bool) and t.replace(".", "", 1).isdigit():
        raise ConfigError(
            f"{key} got '{value}' without a unit: give one, e.g. 80GiB or 80GB (they differ by "
            "7%; nvidia-smi shows MiB)"
        )
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    for unit in sorted(UNITS, key=len, reverse=True):
        number = t[: -len(unit)]
        if t.endswith(unit) and number.replace(".", "", 1).isdigit() and float(number) > 0:
            return int(float(number) * UNITS[unit])
    if t.isdigit() and int(t) > 0:
        return int(t)
    raise ConfigError(f"{key} got '{value}', expected a size such as 5GB, 500MB or 1.5GiB")


def count_text(n: float) -> str:
    """A count for people: 950, 1.07M, 68.98B (three significant digits at least)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}" if n / scale < 100 else f"{n / scale:.0f}{suffix}"
    return f"{n:.0f}"
