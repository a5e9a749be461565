import pytest

from mlxkv.config import EngineConfig, parse_memory


@pytest.mark.parametrize(
    "text, expected",
    [("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5 gb", 1_500_000_000), ("4096", 4096), (1024, 1024)],
)
def test_memory_sizes(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GB", "0", "2TB"])
def test_bad_memory_sizes_are_named(text):
    with pytest.raises(ValueError, match="kv_cache_memory must be a size such as 2GB"):
        parse_memory(text)


def test_num_pages_is_only_for_the_paged_layout():
    with pytest.raises(ValueError, match="num_pages applies to the paged layout"):
        EngineConfig(kv_layout="contiguous", num_pages=10)


def test_sub_byte_sizes_are_refused_not_taken_for_the_default():
    with pytest.raises(ValueError, match=r"kv_cache_memory must be a size .* \(at least one byte\), got '0.5'"):
        EngineConfig(kv_cache_memory="0.5")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(page_size=None), "page_size must be a positive integer, got None"),
        (dict(attention=5), "attention must be 'metal', 'reference' or None, got 5"),
        (dict(kv_cache_fraction=0), r"kv_cache_fraction must be a number in \(0, 1\], got 0"),
        (dict(kv_bits=16), "kv_bits must be 8, 4 or None, got 16"),
        (dict(kv_bits=4, kv_group_size=256), "kv_group_size must be 32, 64 or 128, got 256"),
        (dict(kv_bits=8.0), "kv_bits must be 8, 4 or None, got 8.0"),
        (dict(kv_layout="ring"), "kv_layout must be 'paged' or 'contiguous', got 'ring'"),
        (dict(prefix_caching="yes"), "prefix_caching must be True or False, got 'yes'"),
        (dict(kv_bits=8, kv_group_size=64.0), "kv_group_size must be 32, 64 or 128, got 64.0"),
    ],
)
def test_bad_engine_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_every_setting_is_passed_by_keyword():
    with pytest.raises(TypeError):
        EngineConfig("paged")


def test_an_unknown_setting_is_refused_with_the_names_there_are():
    with pytest.raises(
        TypeError, match="EngineConfig has no setting 'blok_size'; its settings are kv_layout, page_size, num_pages,"
    ):
        EngineConfig(blok_size=8)


def test_the_old_names_of_renamed_settings_work_for_one_release():
    with pytest.warns(DeprecationWarning) as warned:
        config = EngineConfig(block_size=8, num_blocks=10, enable_prefix_caching=False)
    assert (config.page_size, config.num_pages, config.prefix_caching) == (8, 10, False)
    assert [str(w.message) for w in warned] == [
        f"the setting {old} is now called {new}; the old name goes in mlxkv 0.3"
        for old, new in (
            ("block_size", "page_size"),
            ("num_blocks", "num_pages"),
            ("enable_prefix_caching", "prefix_caching"),
        )
    ]
