"""The shared fractions base: validation and parsing, identical for split fractions and the variant mix."""

from __future__ import annotations

from typing import Any

import pytest

from envloop_pipelines.core.benchmark.generator import VARIANTS, BenchmarkConfig, VariantMix
from envloop_pipelines.core.data.splits import SPLITS, SplitFractions
from envloop_pipelines.core.fractions import Fractions


def test_the_names_are_the_declared_constants_in_order() -> None:
    assert SplitFractions.names() == SPLITS and list(SplitFractions().as_dict()) == list(SPLITS)
    assert VariantMix.names() == VARIANTS and list(VariantMix().as_dict()) == list(VARIANTS)
    assert issubclass(SplitFractions, Fractions) and issubclass(VariantMix, Fractions)


@pytest.mark.parametrize("cls, text, expected", [
    (SplitFractions, "train=0.6,val=0.1,dev=0.1,test=0.1,holdout=0.1", SplitFractions()),
    (SplitFractions, " train=0.8 , test=0.2,", SplitFractions(0.8, 0.0, 0.0, 0.2, 0.0)),
    (VariantMix, "clean=0.7,buried=0.3", VariantMix(0.7, 0.0, 0.0, 0.3)),
])
def test_parse_reads_name_value_pairs_and_zeroes_the_rest(cls: type[Fractions], text: str, expected: Fractions) -> None:
    assert cls.parse(text) == expected


@pytest.mark.parametrize("make, message", [
    (lambda: SplitFractions(train=1.5), "fractions.train must be a number in [0, 1], got 1.5"),
    (lambda: SplitFractions(train=True), "fractions.train must be a number in [0, 1], got True"),
    (lambda: VariantMix(removed=-0.1, clean=0.7), "variant_mix.removed must be a number in [0, 1], got -0.1"),
    (lambda: SplitFractions(train=0.5), "fractions must sum to 1 over train, val, dev, test, holdout, got 0.900000"),
    (lambda: VariantMix(clean=0.5), "variant_mix must sum to 1 over clean, override, removed, buried, got 1.100000"),
    (lambda: SplitFractions.parse("train=0.9,tst=0.1"),
     "fractions: unknown split 'tst' in 'train=0.9,tst=0.1'; allowed: train, val, dev, test, holdout"),
    (lambda: VariantMix.parse("clean=0.5,hard=0.5"),
     "variant_mix: unknown variant 'hard' in 'clean=0.5,hard=0.5'; allowed: clean, override, removed, buried"),
    (lambda: VariantMix.parse("clean=x"), "variant_mix.clean: 'x' is not a number"),
])
def test_errors_name_the_field_and_the_allowed_values(make: Any, message: str) -> None:
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value).startswith(message)


def test_values_are_kept_as_given_so_config_hashes_do_not_move() -> None:
    """An int fraction stays an int: the benchmark config hash is over the JSON of the fields."""
    mix = VariantMix(1, 0, 0, 0)
    assert mix.as_dict() == {"clean": 1, "override": 0, "removed": 0, "buried": 0}
    assert isinstance(mix.clean, int)
    assert BenchmarkConfig().to_dict()["variant_mix"] == {"clean": 0.4, "override": 0.2, "removed": 0.2, "buried": 0.2}
