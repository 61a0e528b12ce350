import pytest
import torch

from ropekit.tools.demo.data import EXCLUDED_DIRS, load_corpus, sample_batch, stdlib_files, validation_windows


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(200_000, 40_000)


def test_stdlib_selection_is_deterministic_and_skips_tests_and_third_party():
    first, second = stdlib_files(), stdlib_files()
    assert first == second
    assert len(first) > 100
    assert all(part not in EXCLUDED_DIRS for rel in first for part in rel.split("/")[:-1])


def test_split_is_by_file_and_reproducible(corpus):
    again = load_corpus(200_000, 40_000)
    assert not set(corpus.train_files) & set(corpus.validation_files)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.validation, again.validation)
    assert corpus.train.numel() >= 200_000 and corpus.validation.numel() >= 40_000


def test_corpus_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="train_bytes"):
        load_corpus(0, 10)
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="_bytes"):
        load_corpus(10_000, 10_000, root=tmp_path)


def test_same_generator_state_draws_the_same_batch(corpus):
    a = sample_batch(corpus.train, 4, 32, torch.Generator().manual_seed(3))
    b = sample_batch(corpus.train, 4, 32, torch.Generator().manual_seed(3))
    assert a.shape == (4, 33) and a.dtype == torch.int64
    assert torch.equal(a, b)


def test_every_evaluation_length_predicts_the_same_bytes(corpus):
    targets = []
    for length in (16, 32, 64, 128):
        windows = validation_windows(corpus.validation, length, 128, 5)
        assert windows.shape == (5 * 128 // length, length + 1)
        # Inputs and targets are the same text shifted by one byte.
        assert torch.equal(windows[:, 1:-1], windows[:, 1:][:, :-1])
        targets.append(windows[:, 1:].flatten())
    assert all(torch.equal(t, targets[0]) for t in targets[1:])


def test_validation_windows_reject_lengths_that_do_not_divide(corpus):
    with pytest.raises(ValueError, match="chunk_length"):
        validation_windows(corpus.validation, 48, 128, 2)
    with pytest.raises(ValueError, match="n_chunks"):
        validation_windows(corpus.validation[:100], 16, 64, 4)
