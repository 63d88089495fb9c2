"""The streaming Criteo TSV reader: dlrm's transforms, hashing, bad lines, the split and
resumable positions, on files the tests write."""

from __future__ import annotations

import math

import pytest
import torch

from rocmoe.data.criteo import (NUM_SPARSE, CriteoTSV, Position, count_lines,
                                write_synthetic_criteo)
from rocmoe.errors import DataFormatError

SIZES = [1000] * NUM_SPARSE


def line(label="1", ints=None, cats=None) -> str:
    ints = ints if ints is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [format(0x10 + t, "08x") for t in range(NUM_SPARSE)]
    return "\t".join([label] + ints + cats) + "\n"


def test_dense_features_are_log1p_with_missing_zero_and_negatives_clamped(tmp_path):
    ints = ["3", "", "-5"] + ["0"] * 10
    path = tmp_path / "one.tsv"
    path.write_text(line(ints=ints))
    batch = next(CriteoTSV(path, SIZES, test_every=1000).batches(1))
    torch.testing.assert_close(batch.dense[0, :3], torch.tensor([math.log(4.0), 0.0, 0.0]))
    assert batch.labels.tolist() == [1.0]


def test_categories_are_hex_values_modulo_the_table_size_and_missing_is_zero(tmp_path):
    cats = ["ffffffff", ""] + ["0000000a"] * (NUM_SPARSE - 2)
    path = tmp_path / "one.tsv"
    path.write_text(line(cats=cats))
    sizes = [7, 5] + [3] * (NUM_SPARSE - 2)
    batch = next(CriteoTSV(path, sizes, test_every=1000).batches(1))
    assert batch.sparse[:3, 0].tolist() == [0xFFFFFFFF % 7, 0, 10 % 3]
    indices, offsets = batch.lookups(0)
    assert indices.tolist() == [0xFFFFFFFF % 7] and offsets.tolist() == [0]


def test_stacked_lookups_hold_each_tables_lookups_in_its_row(tmp_path):
    path = tmp_path / "three.tsv"
    path.write_text("".join(line(cats=[f"{n + t:08x}" for t in range(NUM_SPARSE)])
                            for n in range(3)))
    batch = next(CriteoTSV(path, SIZES, test_every=1000).batches(3))
    indices, offsets = batch.stacked_lookups()
    assert indices.shape == offsets.shape == (NUM_SPARSE, 3)
    for t in range(NUM_SPARSE):
        want_indices, want_offsets = batch.lookups(t)
        assert torch.equal(indices[t], want_indices) and torch.equal(offsets[t], want_offsets)


def test_every_nth_line_is_a_test_line(tmp_path):
    path = tmp_path / "ten.tsv"
    path.write_text("".join(line(label=str(n % 2), ints=[str(n)] + ["0"] * 12)
                            for n in range(1, 11)))
    first_int = lambda b: [round(math.exp(v) - 1) for v in b.dense[:, 0].tolist()]  # noqa: E731
    train = CriteoTSV(path, SIZES, "train", test_every=3)
    test = CriteoTSV(path, SIZES, "test", test_every=3)
    assert first_int(next(train.batches(100))) == [1, 2, 4, 5, 7, 8, 10]
    assert first_int(next(test.batches(100))) == [3, 6, 9]
    assert train.samples_in_file() == 7 and test.samples_in_file() == 3


def test_a_malformed_line_is_an_error_naming_the_file_and_line(tmp_path):
    path = write_synthetic_criteo(tmp_path / "bad.tsv", 30, bad_lines=[12])
    with pytest.raises(DataFormatError, match=rf"bad\.tsv:12: expected 40 tab-separated fields"):
        for _ in CriteoTSV(path, SIZES, test_every=1000).batches(4):
            pass


@pytest.mark.parametrize("kind,message", [(1, "label must be 0 or 1"),
                                          (2, "is not an integer"),
                                          (3, "is not hexadecimal")])
def test_each_kind_of_bad_value_is_named(tmp_path, kind, message):
    bad = [100 + i for i in range(kind + 1)]  # the generator cycles through the kinds
    path = write_synthetic_criteo(tmp_path / "bad.tsv", 120, bad_lines=bad)
    reader = CriteoTSV(path, SIZES, test_every=1000, skip_bad=False)
    with pytest.raises(DataFormatError, match=message):
        for _ in reader.batches(200, start=_position_before(path, bad[-1])):
            pass


def _position_before(path, line_number: int) -> Position:
    with open(path, "rb") as f:
        for _ in range(line_number - 1):
            f.readline()
        return Position(offset=f.tell(), line=line_number - 1)


def test_bad_lines_are_skipped_and_counted_when_asked(tmp_path):
    path = write_synthetic_criteo(tmp_path / "bad.tsv", 50, bad_lines=[3, 10, 11, 40])
    reader = CriteoTSV(path, SIZES, test_every=1000, skip_bad=True)
    samples = sum(len(b) for b in reader.batches(8))
    assert samples == 46 and reader.bad_lines == 4


def test_reading_resumes_exactly_at_a_batchs_position(tmp_path):
    path = write_synthetic_criteo(tmp_path / "clicks.tsv", 100, bad_lines=[30], seed=4)
    reader = CriteoTSV(path, SIZES, test_every=7, skip_bad=True)
    batches = list(reader.batches(10))
    resumed = list(reader.batches(10, start=batches[3].position))
    assert len(resumed) == len(batches) - 4
    for a, b in zip(batches[4:], resumed):
        assert torch.equal(a.dense, b.dense) and torch.equal(a.sparse, b.sparse)
        assert a.position == b.position
    assert resumed[-1].position.bad_lines == 1


def test_line_count_includes_a_last_line_without_newline(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_text(line() + line().rstrip("\n"))
    assert count_lines(path) == 2


def test_the_generated_file_has_a_learnable_signal(tmp_path):
    """The demo and tests need a file a model can learn: its labels depend on features."""
    path = write_synthetic_criteo(tmp_path / "clicks.tsv", 3000, seed=2)
    batch = next(CriteoTSV(path, SIZES, test_every=1000).batches(3000))
    hot = batch.dense[:, 0] > math.log(5)   # the first count raises the click odds
    assert batch.labels[hot].mean() > batch.labels[~hot].mean() + 0.1
