"""The disk tier's state dict kept between saves (arc_engine.recovery.state_dict_cache): reused only while it is
the live state, and then the same as a fresh ``get_state_dict``."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from arc_engine.recovery.state import TorchTrainState
from arc_engine.recovery.state_dict_cache import StateDictCache


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optimizer)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _live(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return TorchTrainState(model, optimizer).live_tensors()


def _same(ours: tuple[dict, dict], fresh: tuple[dict, dict]) -> None:
    """Equal to a fresh get_state_dict: the same keys, the same tensors (memory and values), the same settings."""
    (model_ours, optim_ours), (model_fresh, optim_fresh) = ours, fresh
    assert list(model_ours) == list(model_fresh)
    for name, tensor in model_fresh.items():
        assert model_ours[name].data_ptr() == tensor.data_ptr() and torch.equal(model_ours[name], tensor)
    assert set(optim_ours["state"]) == set(optim_fresh["state"])
    for name, entry in optim_fresh["state"].items():
        assert set(optim_ours["state"][name]) == set(entry)
        for key, value in entry.items():
            assert optim_ours["state"][name][key] is value
    assert optim_ours["param_groups"] == optim_fresh["param_groups"]


def test_reused_while_the_live_state_holds_and_the_settings_are_current() -> None:
    model, optimizer = _trained()
    cache = StateDictCache(get_state_dict)
    first = cache.get(model, optimizer, _live(model, optimizer))
    _step(model, optimizer)  # in-place updates: the same tensors
    optimizer.param_groups[0]["lr"] = 5e-4  # a scheduler's write
    again = cache.get(model, optimizer, _live(model, optimizer))
    assert cache.builds == 1
    _same(again, get_state_dict(model, optimizer))
    assert again[1]["param_groups"][0]["lr"] == 5e-4
    assert first[1]["param_groups"][0]["lr"] == 1e-3  # a returned dict is not changed by a later call
    again[0].pop(next(iter(again[0])))  # nor is the kept one by a caller's change
    _same(cache.get(model, optimizer, _live(model, optimizer)), get_state_dict(model, optimizer))


def test_built_again_when_a_tensor_is_replaced_or_state_appears() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cache = StateDictCache(get_state_dict)
    cache.get(model, optimizer, _live(model, optimizer))  # no optimizer state yet
    _step(model, optimizer)
    _same(cache.get(model, optimizer, _live(model, optimizer)), get_state_dict(model, optimizer))
    assert cache.builds == 2
    model.weight.data = model.weight.data.clone() + 1.0  # another tensor under the same name
    optimizer.state[model.bias]["exp_avg"] = torch.ones(2)
    _same(cache.get(model, optimizer, _live(model, optimizer)), get_state_dict(model, optimizer))
    assert cache.builds == 3
    optimizer.param_groups[0]["warmup"] = 10  # a setting a trainer added to the group
    _same(cache.get(model, optimizer, _live(model, optimizer)), get_state_dict(model, optimizer))
    assert cache.builds == 4


class _WithExtraState(torch.nn.Linear):
    calls = 0

    def get_extra_state(self) -> dict:
        type(self).calls += 1
        return {"calls": self.calls}

    def set_extra_state(self, state: dict) -> None:
        pass


def test_never_reused_when_the_state_dict_holds_more_than_live_tensors() -> None:
    torch.manual_seed(0)
    model = _WithExtraState(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optimizer)
    cache = StateDictCache(get_state_dict)
    first = cache.get(model, optimizer, _live(model, optimizer))
    second = cache.get(model, optimizer, _live(model, optimizer))
    assert cache.builds == 2
    assert first[0]["_extra_state"] != second[0]["_extra_state"]  # computed at each save, never a stale one

    computed = torch.nn.Linear(4, 2)  # a state-dict hook that hands out copies: not the live memory
    computed._register_state_dict_hook(lambda module, sd, prefix, meta: {k: v.clone() for k, v in sd.items()})
    optimizer = torch.optim.AdamW(computed.parameters(), lr=1e-3)
    cache = StateDictCache(get_state_dict)
    for _ in range(2):
        cache.get(computed, optimizer, _live(computed, optimizer))
    assert cache.builds == 2


def test_the_train_state_builds_its_state_dict_once_across_saves() -> None:
    model, optimizer = _trained()
    state = TorchTrainState(model, optimizer)
    for _ in range(3):
        train = state.dcp_state_dict()
        _step(model, optimizer)
    assert state._state_dicts.builds == 1
    _same((train["model"], train["optim"]), get_state_dict(model, optimizer))
