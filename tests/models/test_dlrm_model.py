"""DLRM's architecture as facebookresearch/dlrm builds it: widths, interaction, init."""

from __future__ import annotations

import math

import pytest
import torch

from rocmoe.errors import ConfigurationError
from rocmoe.models.dlrm import DLRM, interaction_width, table_range


def test_top_mlp_input_is_the_interactions_width_as_in_dlrm():
    # dlrm's defaults: 3 tables of dim 2, bottom 4-3-2, top 4-2-1
    dot = DLRM(2, [4, 3, 2], [4, 3, 2], [4, 2, 1])
    assert dot.top[0].in_features == 4 * 3 // 2 + 2 == interaction_width("dot", 3, 2)
    itself = DLRM(2, [4, 3, 2], [4, 3, 2], [4, 2, 1], interaction_itself=True)
    assert itself.top[0].in_features == 4 * 5 // 2 + 2
    cat = DLRM(2, [4, 3, 2], [4, 3, 2], [4, 2, 1], interaction="cat")
    assert cat.top[0].in_features == 4 * 2


def test_dot_interaction_is_the_dense_vector_and_the_strict_lower_triangle():
    model = DLRM(2, [5, 5], [3, 2], [1])
    x = torch.tensor([[1.0, 2.0]])
    emb = torch.tensor([[[3.0, 4.0], [5.0, 6.0]]])
    feats = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    dot = lambda a, b: sum(p * q for p, q in zip(feats[a], feats[b]))  # noqa: E731
    expected = [1.0, 2.0, dot(1, 0), dot(2, 0), dot(2, 1)]  # dlrm: for i, for j < i
    assert model.interact(x, emb)[0].tolist() == expected


def test_sigmoid_ends_the_top_mlp_and_relu_follows_every_other_layer():
    model = DLRM(2, [4, 3], [4, 3, 2], [4, 2, 1])
    assert isinstance(model.top[-1], torch.nn.Sigmoid)
    assert all(isinstance(m, torch.nn.ReLU) for m in list(model.bottom)[1::2])
    assert all(isinstance(m, torch.nn.ReLU) for m in list(model.top)[1:-1:2])


def test_tables_are_uniform_within_dlrms_bound():
    model = DLRM(4, [400, 9], [4, 4], [1])
    for table, rows in zip(model.tables, (400, 9)):
        bound = math.sqrt(1.0 / rows)
        assert table.abs().max() <= bound and table.abs().max() > 0.5 * bound


def test_each_rank_holds_a_contiguous_range_of_tables_with_the_same_values():
    sizes = [10, 20, 30, 40, 50]
    whole = DLRM(2, sizes, [3, 2], [1], seed=5)
    assert [list(table_range(r, 2, 5)) for r in (0, 1)] == [[0, 1, 2], [3, 4]]
    second = DLRM(2, sizes, [3, 2], [1], rank=1, world_size=2, seed=5)
    assert torch.equal(second.tables[0], whole.tables[3])
    assert torch.equal(second.top[0].weight, whole.top[0].weight)


def test_mismatched_widths_are_refused_as_dlrm_does():
    with pytest.raises(ConfigurationError, match="does not match the last width of --arch-mlp-bot"):
        DLRM(3, [4, 3, 2], [4, 3, 2], [4, 2, 1])
    with pytest.raises(ConfigurationError, match="dot or cat"):
        DLRM(2, [4, 3, 2], [4, 3, 2], [4, 2, 1], interaction="sum")


def test_the_tables_are_views_of_one_packed_parameter():
    model = DLRM(4, [400, 9], [4, 4], [1])
    assert model.table_parameters() == [model.packed_tables]
    assert model.packed_tables.shape == (409, 4)
    second = model.tables[1]
    assert second.shape == (9, 4)
    assert second.data_ptr() == model.packed_tables.data_ptr() + 400 * 4 * 4
