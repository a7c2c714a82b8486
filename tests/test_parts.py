"""Part hooks are declared on the base classes: called directly, and a misspelled one is an error."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvtrim.budgets.base import BudgetAllocator
from kvtrim.budgets.uniform import UniformBudget
from kvtrim.compression.pipeline import Pipeline
from kvtrim.errors import InvalidParameterError
from kvtrim.methods import get_method, method_names
from kvtrim.parts import declared_hooks
from kvtrim.scoring.base import Scorer
from kvtrim.scoring.key_norm import KeyNormScorer
from kvtrim.selection.base import Selector
from kvtrim.selection.topk import TopKSelector


def test_hooks_are_declared_on_the_bases():
    common = {"bind", "check", "describe_compression"}
    assert declared_hooks(Scorer) == common | {"score", "prepare"}
    assert declared_hooks(BudgetAllocator) == common | {"allocate"}
    assert declared_hooks(Selector) == common | {"select"}


@pytest.mark.parametrize(
    ("base", "misspelled"),
    [(Scorer, "prepar"), (Scorer, "describe_compresion"), (BudgetAllocator, "chek"), (Selector, "bnd")],
)
def test_a_misspelled_hook_is_rejected_when_the_class_is_made(base, misspelled):
    with pytest.raises(TypeError, match="misspelled"):
        type("Custom", (base,), {misspelled: lambda self, *args: None})


def test_hook_overrides_and_unrelated_helpers_are_accepted():
    @dataclass
    class Custom(Scorer):
        def prepare(self, views) -> None:
            self.prepared_views = len(views)

        def helper_norms(self, view) -> torch.Tensor:
            return view.keys.norm(dim=-1)

    custom = Custom()
    custom.prepare([1, 2])
    assert custom.prepared_views == 2 and custom.describe_compression({}) == {}


def test_every_registered_part_derives_from_its_base():
    for name in method_names():
        pipeline = get_method(name)
        assert isinstance(pipeline.scorer, Scorer), name
        assert isinstance(pipeline.budget, BudgetAllocator), name
        assert isinstance(pipeline.selector, Selector), name


def test_a_pipeline_rejects_a_part_without_the_base():
    class Undeclared:  # has score() but not the hooks the compressor calls
        observation = KeyNormScorer().observation

        def score(self, view):
            return -view.keys.norm(dim=-1)

    with pytest.raises(InvalidParameterError, match=r"must subclass kvtrim\.scoring\.base\.Scorer"):
        Pipeline("custom", Undeclared(), UniformBudget(), TopKSelector())
