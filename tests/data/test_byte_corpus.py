"""The standard-library byte corpus: a fixed file-level split, batches that do not depend
on the number of ranks, and the unigram entropy the GPT-MoE has to beat."""

from __future__ import annotations

import math

import pytest
import torch

from rocmoe.data.byte_corpus import (ByteCorpus, is_validation_file, python_files, stdlib_root,
                                     unigram_entropy_bits)
from rocmoe.errors import ConfigurationError


@pytest.fixture(scope="module")
def corpus():
    return ByteCorpus(max_files=200)


def test_the_corpus_is_the_standard_librarys_python_files():
    root = stdlib_root()
    assert (root / "os.py").is_file()
    files = python_files(root)
    assert root / "os.py" in files
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)


def test_split_is_by_file_fixed_and_disjoint(tmp_path):
    for name in ("a.py", "b.py", "pkg/c.py", "pkg/d.py", "e.py", "f.py", "g.py", "h.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(name.encode() * 10)
    corpus = ByteCorpus(tmp_path, validation_percent=40)
    val = {p for p in ("a.py", "b.py", "pkg/c.py", "pkg/d.py", "e.py", "f.py", "g.py", "h.py")
           if is_validation_file(p, 40)}
    assert 0 < len(val) < 8
    expected = b"".join(n.encode() * 10 for n in sorted(val))
    assert bytes(corpus.validation.numpy()) == expected
    assert corpus.train_files + corpus.validation_files == 8


def test_unigram_entropy_of_known_bytes():
    assert unigram_entropy_bits(torch.tensor([7] * 10, dtype=torch.uint8)) == 0.0
    four = torch.tensor([1, 2, 3, 4] * 25, dtype=torch.uint8)
    assert math.isclose(unigram_entropy_bits(four), 2.0)


def test_targets_are_the_inputs_shifted_by_one_byte(corpus):
    x, y = corpus.train_batch(step=5, global_batch=4, seq_len=32)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_a_ranks_rows_are_its_slice_of_the_global_batch(corpus):
    whole = corpus.train_batch(step=9, global_batch=8, seq_len=16)[0]
    parts = [corpus.train_batch(step=9, global_batch=8, seq_len=16, rank=r, world=4)[0]
             for r in range(4)]
    assert torch.equal(torch.cat(parts), whole)
    assert not torch.equal(whole, corpus.train_batch(step=10, global_batch=8, seq_len=16)[0])


def test_validation_batches_are_the_same_every_time(corpus):
    a = corpus.validation_batches(2, 4, 16)
    b = corpus.validation_batches(2, 4, 16)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))


def test_a_batch_the_ranks_cannot_share_is_refused(corpus):
    with pytest.raises(ConfigurationError, match="divisible by 3 ranks"):
        corpus.train_batch(0, global_batch=8, seq_len=16, rank=0, world=3)
