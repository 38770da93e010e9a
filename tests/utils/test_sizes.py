import pytest

from bigtrain.errors import ConfigError
from bigtrain.plan.text import parse_bytes
from bigtrain.utils.sizes import parse_size

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5 * 10**9),
        ("500 MB", 500 * 10**6),
        ("1.5GiB", 3 * 2**29),
        ("81920MiB", 80 * 2**30),
        ("4096", 4096),
        (4096, 4096),
        ("2tb", 2 * 10**12),
    ],
)
def test_sizes_in_decimal_and_binary_units(text, expected):
    assert parse_size(text, "--max-shard-size") == expected


@pytest.mark.parametrize("bad", ["lots", "0GB", "-5MB", 0, "5 GB extra", True])
def test_a_bad_size_names_the_option(bad):
    with pytest.raises(ConfigError, match="--max-shard-size got"):
        parse_size(bad, "--max-shard-size")


def test_plan_keeps_its_option_name():
    assert parse_bytes("80GB") == 80 * 10**9
    with pytest.raises(ConfigError, match="--gpu-memory got 'lots'"):
        parse_bytes("lots")
    for bare in ("80", "80.5", 85899345920):  # GB or GiB? never bytes
        with pytest.raises(ConfigError, match="without a unit: give one, e.g. 80GiB or 80GB"):
            parse_bytes(bare)
    assert parse_bytes("80GiB") == 80 * 2**30


@pytest.mark.unit
def test_counts_read_as_people_write_them():
    from bigtrain.utils.sizes import count_text

    assert [count_text(n) for n in (950, 127_000, 1_070_000, 68_976_648_192, 405e9)] == [
        "950",
        "127K",
        "1.07M",
        "69B",
        "405B",
    ]
