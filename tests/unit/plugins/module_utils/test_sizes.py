# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import SizeError, human_bytes, parse_size

GIB = 1024**3


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),
        (100000000, 100000000),
        ("100000000", 100000000),
        ("512", 512),
        ("512B", 512),
        ("0.5GiB", GIB // 2),
        ("28.25GiB", 30333206528),
        ("40.75 GiB", int(40.75 * GIB)),
        ("1KiB", 1024),
        ("2MiB", 2 * 1024**2),
        ("1TiB", 1024**4),
        ("30G", 30 * GIB),  # vLLM: upper-case single letter is binary
        ("30g", 30 * 10**9),  # vLLM: lower-case single letter is decimal
        ("1.5g", 1_500_000_000),
        ("4k", 4000),
        ("4K", 4096),
        ("1kB", 1000),
        ("1KB", 1000),
        ("3MB", 3_000_000),
        ("2GB", 2 * 10**9),
        ("1TB", 10**12),
        ("1_000", 1000),
        (1e9, 10**9),
        (" 7M ", 7 * 1024**2),
    ],
)
def test_parse_size(value, expected):
    assert parse_size(value, "f") == expected


@pytest.mark.parametrize(
    "value, why",
    [
        (-1, "negative"),
        ("-1GiB", "negative"),
        ("0.3B", "whole number"),
        ("1.0000001KiB", "whole number"),
        (0.5, "whole number"),
        ("12 parsecs", "unknown unit"),
        ("1gib", "unknown unit"),
        ("GiB", "expected a number"),
        ("", "expected a number"),
        (True, "boolean"),
        (False, "boolean"),
        (None, "required"),
        ([1], "expected an integer or a string"),
        (float("nan"), "finite"),
    ],
)
def test_parse_size_rejects(value, why):
    with pytest.raises(SizeError) as exc:
        parse_size(value, "guard_bytes")
    text = str(exc.value)
    assert text.startswith("guard_bytes: ")
    assert why in text
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0B"),
        (512, "512B"),
        (1024, "1KiB"),
        (30333206528, "28.25GiB"),
        (30 * GIB, "30GiB"),
        (100000000, "95.37MiB"),
        (-(GIB + GIB // 4), "-1.25GiB"),
        (5 * 1024**5, "5PiB"),
    ],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_human_bytes_precision():
    assert human_bytes(100000000, 1) == "95.4MiB"
    assert human_bytes(100000000, 0) == "95MiB"
    with pytest.raises(SizeError):
        human_bytes(1, -1)
    with pytest.raises(SizeError):
        human_bytes(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "n, text",
    [
        (30333206528, "28.25GiB"),
        (100000000, "100MB"),
        (1000, "1kB"),
        (1001, "1001"),
        (3 * 1024**3 + 1, "3221225473"),
        (1024, "1KiB"),
        (1536, "1.5KiB"),
        (7, "7"),
        (0, "0"),
    ],
)
def test_human_bytes_exact(n, text):
    assert human_bytes(n, exact=True) == text
    assert parse_size(text, "x") == n


@given(st.integers(min_value=0, max_value=2**62))
def test_exact_mode_round_trips(n):
    assert parse_size(human_bytes(n, exact=True), "x") == n


@given(st.integers(min_value=0, max_value=2**60))
def test_rounded_mode_is_close(n):
    text = human_bytes(n, 2)
    number = float(text.rstrip("KMGTPiB"))
    assert 0 <= number < 1024 or text.endswith("PiB")
    back = parse_size(human_bytes(n, 6), "x") if n < 1024 else None
    if back is not None:
        assert back == n
    if n >= 1024:
        # two decimals of the unit: relative error at most 0.005 / 1
        unit = parse_size("1" + text.lstrip("0123456789."), "x")
        assert abs(number * unit - n) <= 0.005 * unit + 1


def test_rounding_up_moves_to_the_next_unit():
    assert human_bytes(1024 * 1024 - 1) == "1MiB"
    assert human_bytes(1023) == "1023B"
