import pytest
import torch

from ropekit.tools.demo.data import (
    EXCLUDED_DIRS,
    KEY_CLOSE,
    KEY_DIGITS,
    KEY_OPEN,
    key_distance,
    load_corpus,
    passkey_windows,
    sample_batch,
    stdlib_files,
    validation_windows,
)


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


def _key_positions(row: torch.Tensor) -> list[int]:
    return (row == KEY_OPEN).nonzero().flatten().tolist()


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_is_stated_once_at_the_requested_depth_and_asked_for_at_the_end(corpus, depth):
    length = 128
    tokens, answers = passkey_windows(corpus.train, 6, length, torch.Generator().manual_seed(0), depth)
    assert tokens.shape == answers.shape == (6, length + 1) and tokens.dtype == torch.int64
    filler_len = length + 1 - (KEY_DIGITS + 2) - 1 - KEY_DIGITS
    for row, answer in zip(tokens, answers, strict=True):
        opens = _key_positions(row)
        # STX twice: once stating the key, once as the query right before the answer.
        assert opens == [round(depth * filler_len), length - KEY_DIGITS]
        assert (row == KEY_CLOSE).sum() == 1
        stated = row[opens[0] + 1 : opens[0] + 1 + KEY_DIGITS]
        assert row[opens[0] + 1 + KEY_DIGITS] == KEY_CLOSE
        assert bool(((stated >= ord("0")) & (stated <= ord("9"))).all())
        assert stated.unique().numel() == KEY_DIGITS  # distinct digits: "the digit after d" is unambiguous
        assert torch.equal(row[-KEY_DIGITS:], stated)
        assert answer.nonzero().flatten().tolist() == list(range(length + 1 - KEY_DIGITS, length + 1))


def test_passkey_filler_is_the_corpus_text_around_the_key(corpus):
    tokens, _ = passkey_windows(corpus.train, 3, 64, torch.Generator().manual_seed(1), 0.5)
    text = bytes(corpus.train.tolist())
    for row in tokens:
        opens = _key_positions(row)
        filler = torch.cat([row[: opens[0]], row[opens[0] + KEY_DIGITS + 2 : opens[1]]])
        assert bytes(filler.tolist()) in text  # one contiguous run of real source


def test_passkey_curriculum_keeps_drawn_depths_at_or_above_min_depth(corpus):
    length = 128
    filler_len = length + 1 - (KEY_DIGITS + 2) - 1 - KEY_DIGITS
    tokens, _ = passkey_windows(corpus.train, 200, length, torch.Generator().manual_seed(2), min_depth=0.8)
    starts = torch.tensor([_key_positions(row)[0] for row in tokens])
    assert int(starts.min()) >= round(0.8 * filler_len) and int(starts.max()) <= filler_len
    assert starts.unique().numel() > 10  # drawn, not fixed


def test_passkey_windows_are_reproducible_and_reject_bad_arguments(corpus):
    a = passkey_windows(corpus.train, 2, 64, torch.Generator().manual_seed(3))
    b = passkey_windows(corpus.train, 2, 64, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="depth"):
        passkey_windows(corpus.train, 1, 64, torch.Generator(), 1.5)
    with pytest.raises(ValueError, match="length"):
        passkey_windows(corpus.train, 1, 8, torch.Generator())
    with pytest.raises(ValueError, match="min_depth"):
        passkey_windows(corpus.train, 1, 64, torch.Generator(), None, min_depth=-0.1)


def test_passkey_filler_never_contains_the_key_delimiters():
    stream = torch.tensor([KEY_OPEN, KEY_CLOSE, ord("a")] * 100, dtype=torch.uint8)
    tokens, _ = passkey_windows(stream, 3, 40, torch.Generator().manual_seed(0), 0.5)
    assert all((row == KEY_OPEN).sum() == 2 and (row == KEY_CLOSE).sum() == 1 for row in tokens)


@pytest.mark.parametrize("length", [13, 64, 257])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_key_distance_is_the_query_position_minus_the_first_digits(length, depth):
    stream = torch.full((4096,), ord("a"), dtype=torch.uint8)
    tokens, _ = passkey_windows(stream, 1, length, torch.Generator().manual_seed(0), depth)
    inputs = tokens[0, :-1]  # the model sees these; the query is the last STX among them
    stx = (inputs == KEY_OPEN).nonzero().flatten().tolist()
    assert len(stx) == 2
    assert key_distance(length, depth) == stx[1] - (stx[0] + 1)


def test_key_distance_rejects_what_passkey_windows_rejects():
    with pytest.raises(ValueError, match="length"):
        key_distance(12, 0.5)
    with pytest.raises(ValueError, match="depth"):
        key_distance(64, 1.5)
