"""Byte sizes: the one place that formats and parses them.

Binary units (KiB = 1024 B) are what torch, NVML and the OS report memory in; decimal ones (KB =
1000 B) are what disks and networks are sold in. A bare letter (64K, 256M, 1G) is binary, as
nccl-tests reads it.
"""
from __future__ import annotations

import re

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

UNITS = {"b": 1, "byte": 1, "bytes": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB,
         "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"\s*([0-9][0-9,]*(?:\.[0-9]+)?)\s*(bytes|byte|[KMGT]i?B|[KMGT]|B)?\s*",
                   re.IGNORECASE)


def parse_size(text: str | int, *, decimal_si: bool = True) -> int:
    """'2.00 GiB' -> 2147483648; '1.5 GB' -> 1500000000; '64K' -> 65536; 42 -> 42.
    decimal_si=False reads KB/MB/GB as binary too (nccl-tests' sizes)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"size: got {text!r}; accepted: a number of bytes, optionally with a unit: "
                         "B, K/M/G/T or KiB/MiB/GiB/TiB (powers of 1024), KB/MB/GB/TB (powers of "
                         "1000)")
    unit = (m.group(2) or "b").lower()
    if not decimal_si and unit in ("kb", "mb", "gb", "tb"):
        unit = unit[0]
    return int(round(float(m.group(1).replace(",", "")) * UNITS[unit]))


def fmt_bytes(n: float | None, digits: int = 2) -> str:
    """Binary units, as torch's out-of-memory message writes them: 2147483648 -> '2.00 GiB'."""
    if n is None:
        return "?"
    n = float(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} bytes"


__all__ = ["KiB", "MiB", "GiB", "TiB", "UNITS", "parse_size", "fmt_bytes"]
