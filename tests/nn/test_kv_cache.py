"""KVCache: writes land at each row's fill length, and overflow is refused."""

import pytest
import torch

from ropekit.nn import KVCache


def test_update_writes_at_each_rows_length_and_advances():
    cache = KVCache(2, 6, 1, 2)
    cache.lengths.copy_(torch.tensor([1, 3]))
    k = torch.arange(8.0).view(2, 2, 1, 2)
    start = cache.update(k, -k)
    assert start.tolist() == [1, 3]
    assert cache.lengths.tolist() == [3, 5]
    torch.testing.assert_close(cache.k[0, 1:3], k[0])
    torch.testing.assert_close(cache.k[1, 3:5], k[1])
    torch.testing.assert_close(cache.v[1, 3:5], -k[1])
    assert cache.k[0, 0].abs().sum() == 0 and cache.k[1, :3].abs().sum() == 0


def test_overflow_and_bad_shapes_raise():
    cache = KVCache(1, 3, 1, 2)
    with pytest.raises(ValueError, match="max_len"):
        cache.update(torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2))
    with pytest.raises(ValueError, match="k, v"):
        cache.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match="max_len"):
        KVCache(1, 0, 1, 2)


def test_reset_empties_the_cache():
    cache = KVCache(1, 3, 1, 2)
    cache.update(torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2))
    cache.reset()
    assert cache.lengths.tolist() == [0]
