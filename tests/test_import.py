import hybrid_cache


def test_version_is_exposed():
    assert hybrid_cache.__version__.count(".") == 2
