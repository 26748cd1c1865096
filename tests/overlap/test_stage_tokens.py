"""The step's largest stage token count, as the adaptive bucket reads it
from the DP metadata: the emulation's ``num_tokens``, or the sum of vLLM's
``num_tokens_across_dp_cpu`` in whatever form it comes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from camp2p_overlap.core.overlap.camp2p import max_stage_tokens


def across(value: object) -> SimpleNamespace:
    return SimpleNamespace(num_tokens_across_dp_cpu=value)


@pytest.mark.parametrize(
    ("value", "tokens"),
    [
        (torch.tensor([1, 2, 3, 4]), 10),
        (torch.tensor([1, 2, 3, 4], dtype=torch.int32), 10),
        (torch.tensor(7), 7),  # 0-dim
        (torch.tensor([[1, 2], [3, 4]]), 10),  # nested: the tensor's own sum
        (torch.tensor([1.0, 2.5]), 3),  # not integers: the tensor's own sum, truncated by int()
        ([3, 5], 8),
        ((3, 5), 8),
        ("many", 0),
    ],
    ids=["int64", "int32", "0-dim", "2-dim", "float", "list", "tuple", "str"],
)
def test_tokens_across_dp_are_summed(value: object, tokens: int) -> None:
    assert max_stage_tokens({0: across(value)}) == tokens


def test_the_largest_stage_counts_and_num_tokens_wins() -> None:
    dp = {0: across(torch.tensor([1, 1])), 1: across(torch.tensor([4, 4])), 2: SimpleNamespace(num_tokens=5)}
    assert max_stage_tokens(dp) == 8
    assert max_stage_tokens({0: SimpleNamespace(num_tokens=3, num_tokens_across_dp_cpu=torch.tensor([9]))}) == 3
    assert max_stage_tokens({}) == 0 and max_stage_tokens(None) == 0
    assert max_stage_tokens({0: SimpleNamespace()}) == 0
