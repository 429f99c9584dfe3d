"""The open model registry: a family or a flavor is added by calling it, not by editing titan, and a
name registered twice is refused unless the caller asks to replace it."""

from __future__ import annotations

import dataclasses

import pytest

import titan.models
from tests.helpers.tiny import TINY, extra_flavors
from titan.errors import TitanError
from titan.models import get_flavor, get_model_spec, register_flavor, register_model_spec
from titan.training.checks import load_job


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, put back after the test (whatever the test registered)."""
    monkeypatch.setattr(titan.models._REGISTRY, "_specs", dict(titan.models._REGISTRY.specs()))


def test_a_registered_family_is_selected_by_model_name(registry):
    spec = dataclasses.replace(get_model_spec("llama3"), name="mini", flavors={"tiny": TINY})
    register_model_spec(spec)
    found = get_model_spec("mini")
    assert found.model_cls is spec.model_cls and dict(found.flavors) == {"tiny": TINY}
    with pytest.raises(TypeError):  # the registry keeps a read-only copy of the table it was given
        found.flavors["other"] = TINY  # type: ignore[index]
    config = load_job(["--model.name", "mini", "--model.flavor", "tiny"])
    assert config.model.name == "mini"
    with pytest.raises(TitanError, match="config key 'model.flavor' got 'debugmodel'; valid for mini: tiny"):
        load_job(["--model.name", "mini"])


def test_registering_a_name_twice_is_refused_unless_replaced(registry):
    llama3 = get_model_spec("llama3")
    with pytest.raises(TitanError) as e:
        register_model_spec(llama3)
    assert str(e.value) == "model 'llama3' is registered already; pass replace=True to replace its spec"
    register_model_spec(dataclasses.replace(llama3, flavors={"tiny": TINY}), replace=True)
    assert list(get_model_spec("llama3").flavors) == ["tiny"]


def test_register_flavor_adds_a_size_to_a_registered_family(registry):
    register_flavor("llama3", "tiny", TINY)
    assert get_flavor(get_model_spec("llama3"), "tiny") == TINY
    assert "debugmodel" in get_model_spec("llama3").flavors  # the shipped flavors stay
    load_job(["--model.flavor", "tiny", "--training.seq_len", "32"])
    with pytest.raises(TitanError, match="model 'llama3' has a flavor 'tiny' already; pass replace=True"):
        register_flavor("llama3", "tiny", TINY)
    register_flavor("llama3", "tiny", dataclasses.replace(TINY, n_layers=1), replace=True)
    assert get_flavor(get_model_spec("llama3"), "tiny").n_layers == 1
    with pytest.raises(TitanError, match="flavor 'bad' of model 'llama3' must be a TransformerModelArgs, got dict"):
        register_flavor("llama3", "bad", {"dim": 64})
    with pytest.raises(TitanError, match="config key 'model.name' got 'gpt9'"):
        register_flavor("gpt9", "tiny", TINY)


def test_registered_args_are_a_copy():
    args = dataclasses.replace(TINY)
    with extra_flavors(tiny=args):
        args.n_layers = 7  # changing the caller's object later does not change the flavor
        assert get_model_spec("llama3").flavors["tiny"].n_layers == TINY.n_layers
    assert "tiny" not in get_model_spec("llama3").flavors  # extra_flavors put the spec back
