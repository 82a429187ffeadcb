"""gpu_lab.units, the one home of byte sizes: what every memory message, OOM report and size
option reads and writes."""
from __future__ import annotations

import pytest

from gpu_lab.units import GiB, KiB, MiB, TiB, fmt_bytes, parse_size


@pytest.mark.parametrize("n, text", [
    (0, "0 bytes"), (1023, "1023 bytes"), (KiB, "1.00 KiB"), (1536, "1.50 KiB"),
    (256 * MiB, "256.00 MiB"), (2 * GiB, "2.00 GiB"), (int(79.15 * GiB), "79.15 GiB"),
    (3 * TiB, "3.00 TiB"), (-2 * MiB, "-2.00 MiB"), (None, "?"),
])
def test_fmt_bytes_writes_binary_units_as_torch_does(n, text):
    assert fmt_bytes(n) == text


def test_fmt_bytes_digits():
    assert fmt_bytes(1.5 * GiB, digits=1) == "1.5 GiB"


@pytest.mark.parametrize("text, n", [
    ("2.00 GiB", 2 * GiB), ("1.5 GB", 1_500_000_000), ("64K", 64 * KiB), ("256M", 256 * MiB),
    ("1g", GiB), ("12 bytes", 12), ("1 byte", 1), ("3 B", 3), ("1,024 KiB", MiB),
    ("2 TB", 2 * 10**12), ("1 TiB", TiB), (" 7 ", 7), (42, 42),
])
def test_parse_size_reads_what_people_write(text, n):
    assert parse_size(text) == n


def test_parse_size_reads_decimal_names_as_binary_where_a_tool_does():
    assert parse_size("8MB", decimal_si=False) == 8 * MiB  # nccl-tests' sizes
    assert parse_size("8MB") == 8 * 10**6


@pytest.mark.parametrize("bad", ["", "GiB", "1.5.2 GB", "12 parsecs", "-3 MiB", True])
def test_parse_size_refuses_with_what_it_accepts(bad):
    with pytest.raises(ValueError, match="accepted: a number of bytes, optionally with a unit"):
        parse_size(bad)
