"""Every recipe in configs/ resolves: its keys are shared settings or its method's own, typed and in range."""

from pathlib import Path

import pytest

from gcfamily.config import validate
from gcfamily.methods import get_method, resolve

RECIPES = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_recipes():
    assert len(RECIPES) >= 5


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_resolves_and_validates(path):
    cfg = resolve(str(path), {})
    validate(cfg)
    cls = get_method(cfg.method)
    cls.validate(cfg)
    assert isinstance(cfg.settings, cls.Settings)
