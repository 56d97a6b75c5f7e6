"""Memory sizes: the one parser behind every `--kv-cache-memory`-style flag."""

import pytest
from hybrid_cache.errors import HybridCacheError, MemorySizeError
from hybrid_cache.sizes import format_memory_size, parse_memory_size


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        (0, 0),
        (123, 123),
        ("123", 123),
        ("123B", 123),
        ("1KB", 1000),
        ("512MB", 512 * 1000**2),
        ("40GB", 40 * 1000**3),
        ("2TB", 2 * 1000**4),
        ("1KiB", 1024),
        ("28MiB", 28 * 1024**2),
        ("40GiB", 40 * 1024**3),
        ("1TiB", 1024**4),
        ("40gib", 40 * 1024**3),
        ("40 GIB", 40 * 1024**3),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("0.5kb", 500),
        (" 7 mib ", 7 * 1024**2),
    ],
)
def test_parses_plain_bytes_and_units(text, num_bytes):
    assert parse_memory_size(text) == num_bytes


@pytest.mark.parametrize(
    "bad",
    ["", "GiB", "40XB", "40 G", "-1GiB", "1e9", "1.5", "0.1B", "40GiB extra", -1, 1.5, True, None],
)
def test_rejects_bad_sizes_with_a_typed_error(bad):
    with pytest.raises(MemorySizeError) as caught:
        parse_memory_size(bad)
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, HybridCacheError)


def test_error_message_names_the_units():
    with pytest.raises(MemorySizeError, match="KiB, MiB, GiB"):
        parse_memory_size("40XB")


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (40 * 1024**3, "40.00 GiB"),
        (3 * 1024**2 // 2, "1.50 MiB"),
        (2 * 1024**4, "2.00 TiB"),
    ],
)
def test_formats_binary_units(num_bytes, text):
    assert format_memory_size(num_bytes) == text


def test_format_round_trips_through_parse():
    assert parse_memory_size(format_memory_size(40 * 1024**3).replace(" ", "")) == 40 * 1024**3
