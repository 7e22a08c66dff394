"""The state faults (``grad_scale``, ``data_corruption``, ``optimizer_state``, ``collective_corruption``,
``weight_corruption``, ``hardware_events``, ``memory_leak``) in one process: each acts exactly on its active steps
(against a clean computation of the same step, bitwise where the fault is a plain scaling), draws its random choices
deterministically from (seed, step), is refused with a clear error when misconfigured, and leaves nothing behind after
``remove()``; through ``arc_engine.attach`` on a plain AdamW model, the engine's update hook and event source are
registered only for such a fault, heal_step touches nothing on inactive steps, and an optimizer-state fault at step k
leaves the parameters bitwise equal to a clean run's before k and different from step k on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import arc_engine
from arc_engine.config import ConfigError, load_config
from arc_engine.config.schema import FaultSpec
from arc_engine.faults import FaultInjector
from arc_engine.faults.state_faults import MIB, corrupt_tokens, perturb, seeded_generator
from arc_engine.integrations.pytorch.fsdp import FSDPAdapter
from arc_engine.recovery.heal import heal_step
from tests.training import BATCH, make_config, make_optimizer, tiny_model_and_data

VOCAB = 50


class Clock:
    """The step attempt the injector reads."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self) -> int:
        return self.step


class TokenModel(nn.Module):
    """Token ids -> logits: an embedding, a norm and a wide linear head (enough elements for fractions)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)))


def make_model() -> TokenModel:
    torch.manual_seed(0)
    return TokenModel()


def tokens(seed: int = 1, shape: tuple[int, ...] = (64, 64)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def gradients(model: nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def injector(clock: Clock, model: nn.Module | None = None, this_rank: int = 0, **spec: Any) -> FaultInjector:
    """An injector on global rank ``this_rank`` holding one fault ``spec``, installed on ``model`` if given."""
    faults = FaultInjector([FaultSpec(**spec)], rank=this_rank, current_step=clock)
    if model is not None:
        faults.install(model)
    return faults


# ------------------------------------------------------------------------------------------------- grad_scale


def test_grad_scale_scales_the_matching_gradients_on_the_active_steps_only() -> None:
    model, batch, clock = make_model(), tokens(), Clock()
    clean = gradients(model, batch)
    faults = injector(clock, model, kind="grad_scale", rank=0, step=1, steps=2, scale=-3.0, pattern="head.*")
    for step in range(4):
        clock.step = step
        seen = gradients(model, batch)
        for name, grad in seen.items():
            expected = clean[name] * -3.0 if step in (1, 2) and name.startswith("head.") else clean[name]
            assert torch.equal(grad, expected), (step, name)
    assert faults.fired == [(1, "grad_scale"), (2, "grad_scale")]
    faults.remove()
    clock.step = 1
    assert all(torch.equal(g, clean[n]) for n, g in gradients(model, batch).items())


def test_grad_scale_rate_and_noise_change_that_fraction_deterministically() -> None:
    model, batch, clock = make_model(), tokens(), Clock()
    clean = gradients(model, batch)["head.weight"]
    injector(clock, model, kind="grad_scale", rank=-1, step=0, steps=3, scale=-50.0, rate=0.25, seed=7)
    first = gradients(model, batch)["head.weight"]
    changed = first != clean
    assert 0.22 < changed.float().mean().item() < 0.28  # 4096 elements, rate 0.25
    assert torch.equal(first[changed], clean[changed] * -50.0)  # the gradient-sign "bit flip" of the R-Metric
    assert torch.equal(gradients(model, batch)["head.weight"], first)  # same step: same draw (micro-batch, recompute)
    clock.step = 1
    assert not torch.equal(gradients(model, batch)["head.weight"] != clean, changed)  # another step, another draw


def test_perturb_adds_noise_in_multiples_of_the_rms() -> None:
    values = torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * 3.0
    rms = values.pow(2).mean().sqrt()
    noisy = perturb(values, scale=1.0, noise=2.0, rate=None, generator=seeded_generator(1))
    assert (noisy - values).std().item() == pytest.approx(2.0 * rms.item(), rel=0.02)
    assert torch.equal(perturb(values, scale=2.0, noise=0.0, rate=None, generator=seeded_generator(1)), values * 2.0)
    again = perturb(values, scale=1.0, noise=2.0, rate=None, generator=seeded_generator(1))
    assert torch.equal(noisy, again)


def test_grad_scale_refuses_a_pattern_matching_no_parameter() -> None:
    with pytest.raises(ValueError, match=r"grad_scale pattern 'blocks\.\*' matches no trainable parameter.*head"):
        injector(Clock(), make_model(), kind="grad_scale", rank=0, step=0, pattern="blocks.*")


def test_fsdp2_refuses_grad_scale_like_the_other_tensor_hook_faults(tmp_path: Path) -> None:
    config = make_config(tmp_path, "faults.injections=[{kind: grad_scale, rank: 0, step: 1}]")
    with pytest.raises(ValueError, match=r"\['grad_scale'\] are not supported under FSDP2.*weight_corruption"):
        FSDPAdapter.check_config(config)
    FSDPAdapter.check_config(make_config(tmp_path, "faults.injections=[{kind: weight_corruption, rank: 0, step: 1}]"))


# -------------------------------------------------------------------------------------------- data_corruption


def seen_tokens(model: TokenModel) -> list[torch.Tensor]:
    """What the embedding receives on each forward (after the fault's pre-hook on the model)."""
    seen: list[torch.Tensor] = []
    model.embed.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    return seen


def test_data_corruption_replaces_that_fraction_of_token_ids_on_active_steps() -> None:
    model, batch, clock = make_model(), tokens(), Clock()
    original = batch.clone()
    faults = injector(clock, model, kind="data_corruption", rank=0, step=1, rate=0.2, seed=3)
    seen = seen_tokens(model)
    for step in (0, 1, 1, 2):  # step 1 twice: two micro-batches (or a recomputation) of one step
        clock.step = step
        model(batch)
    assert torch.equal(batch, original)  # the caller's tensor is not modified
    assert torch.equal(seen[0], batch) and torch.equal(seen[3], batch)
    corrupted = seen[1]
    changed = (corrupted != batch).float().mean().item()
    assert 0.2 * 0.9 < changed < 0.2 * 1.1 * (1 - 1 / VOCAB)  # a replacement may draw the same id
    assert corrupted.dtype == batch.dtype and int(corrupted.min()) >= 0 and int(corrupted.max()) < VOCAB
    assert torch.equal(seen[2], corrupted)
    assert faults.fired == [(1, "data_corruption")]


def test_data_corruption_defaults_to_a_third_and_uses_the_embedding_vocabulary() -> None:
    batch = tokens(shape=(200, 100))
    corrupted = corrupt_tokens(batch, 0.3, 7, seeded_generator(0))
    replaced = corrupted != batch
    assert 0.27 < replaced.float().mean().item() < 0.31
    assert int(corrupted[replaced].max()) < 7  # the replacements come from [0, vocab)
    model, clock = make_model(), Clock()
    injector(clock, model, kind="data_corruption", rank=0, step=0)
    seen = seen_tokens(model)
    model(batch)
    assert 0.28 * (1 - 1 / VOCAB) < (seen[0] != batch).float().mean().item() < 0.32


def test_data_corruption_refuses_a_model_without_embedding_and_non_integer_input() -> None:
    with pytest.raises(ValueError, match="data_corruption needs a token embedding"):
        injector(Clock(), nn.Linear(4, 4), kind="data_corruption", rank=0, step=0)
    model, clock = nn.Sequential(nn.Embedding(VOCAB, 4)), Clock()
    clock.step = -1
    injector(clock, model, kind="data_corruption", rank=0, step=0)
    model(torch.tensor([0.5]).long())  # inactive: nothing is checked
    clock.step = 0
    with pytest.raises(TypeError, match=r"integer tensor\) as the first positional argument.*torch\.float32"):
        model(torch.tensor([0.5]))


# ------------------------------------------------------------------------------------------ weight_corruption


def test_weight_corruption_zeroes_that_fraction_once_per_active_step() -> None:
    model, batch, clock = make_model(), tokens(), Clock()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    faults = injector(clock, model, kind="weight_corruption", rank=0, step=1, scale=0.0, rate=0.3,
                      pattern="head.weight")
    model(batch)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    clock.step = 1
    model(batch)
    zeroed = model.head.weight == 0
    assert 0.27 < zeroed.float().mean().item() < 0.33  # ARC's silent weight corruption: sparsity
    assert torch.equal(model.head.weight[~zeroed], before["head.weight"][~zeroed])
    after_first = model.head.weight.detach().clone()
    model(batch)  # a second forward of the same step attempt: not again
    clock.step = 2
    model(batch)  # past the window
    assert torch.equal(model.head.weight, after_first)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n != "head.weight")
    assert faults.fired == [(1, "weight_corruption")]


def test_weight_corruption_scale_is_exact_and_persistent_reapplies() -> None:
    model, batch, clock = make_model(), tokens(), Clock()
    before = model.norm.weight.detach().clone()
    injector(clock, model, kind="weight_corruption", rank=0, step=0, persistent=True, scale=100.0, pattern="*norm*")
    for step in range(3):
        clock.step = step
        model(batch)
    assert torch.equal(model.norm.weight, before * 100.0 * 100.0 * 100.0)  # ARC's weight sabotage, every step


def test_weight_corruption_refuses_a_pattern_matching_no_parameter() -> None:
    with pytest.raises(ValueError, match=r"weight_corruption pattern '\*experts\*' matches no parameter.*head"):
        injector(Clock(), make_model(), kind="weight_corruption", rank=0, step=0, pattern="*experts*")


# ------------------------------------------------------------------------------------------------ memory_leak


def test_memory_leak_holds_more_each_active_step_until_removed() -> None:
    model, batch, clock = make_model(), tokens(shape=(2, 2)), Clock()
    faults = injector(clock, model, kind="memory_leak", rank=0, step=1, steps=3, megabytes=0.25)
    (leak,) = faults.state_faults
    held = []
    for step in range(6):
        clock.step = step
        model(batch)
        model(batch)  # a second micro-batch: once per step attempt
        held.append(leak.held_bytes)
    quarter = MIB // 4
    assert held == [0, quarter, 2 * quarter, 3 * quarter, 3 * quarter, 3 * quarter]
    assert all(block.device == model.head.weight.device and not block.any() for block in leak.blocks)
    faults.remove()
    assert leak.held_bytes == 0 and leak.blocks == []


# ------------------------------------------------------------------------- optimizer_state, collective_corruption


def adam_with_state(model: nn.Module, batch: torch.Tensor) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gradients(model, batch)
    optimizer.step()
    gradients(model, batch)
    return optimizer


def test_optimizer_state_scales_the_chosen_moment_on_active_steps() -> None:
    model, batch, clock = make_model(), tokens(), Clock()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    faults = injector(clock, kind="optimizer_state", rank=0, step=0, steps=2, scale=1e-8, state_key="exp_avg_sq")
    faults.before_update(fresh.param_groups, fresh.state)  # no state yet (the first step): skipped, not recorded
    assert faults.fired == [] and len(fresh.state) == 0
    optimizer = adam_with_state(model, batch)
    state = optimizer.state
    before = {id(p): {k: v.clone() for k, v in state[p].items()} for p in model.parameters()}
    clock.step = 1
    faults.before_update(optimizer.param_groups, state)
    for p in model.parameters():
        assert torch.equal(state[p]["exp_avg_sq"], before[id(p)]["exp_avg_sq"] * 1e-8)
        assert torch.equal(state[p]["exp_avg"], before[id(p)]["exp_avg"])
    clock.step = 2
    faults.before_update(optimizer.param_groups, state)
    assert all(torch.equal(state[p]["exp_avg_sq"], before[id(p)]["exp_avg_sq"] * 1e-8) for p in model.parameters())
    assert faults.fired == [(1, "optimizer_state")]


def test_collective_corruption_scales_the_reduced_gradient_with_probability_rate() -> None:
    model, batch, clock = make_model(), tokens(), Clock()
    optimizer = adam_with_state(model, batch)
    clean = {name: p.grad.clone() for name, p in model.named_parameters()}
    faults = injector(clock, kind="collective_corruption", rank=0, step=5, persistent=True, scale=8.0, rate=0.5,
                      seed=2)
    hits = []
    for step in range(205):
        clock.step = step
        for p, grad in zip(model.parameters(), clean.values(), strict=True):
            p.grad = grad.clone()
        faults.before_update(optimizer.param_groups, optimizer.state)
        hit = torch.equal(model.head.weight.grad, clean["head.weight"] * 8.0)
        assert hit or torch.equal(model.head.weight.grad, clean["head.weight"])
        assert all(torch.equal(p.grad, clean[n] * (8.0 if hit else 1.0)) for n, p in model.named_parameters())
        hits.append(hit)
    assert not any(hits[:5])  # before the window
    assert 70 < sum(hits[5:]) < 130  # NCCL_BUG: a failed all-reduce with probability 0.5 per step
    assert [step for step, _ in faults.fired] == [step for step, hit in enumerate(hits) if hit]
    again = injector(Clock(), kind="collective_corruption", rank=0, step=5, persistent=True, rate=0.5, seed=2)
    assert [again.state_faults[0].fires_at(step) for step in range(5, 205)] == hits[5:]  # the same draw per step


@pytest.mark.parametrize("kind", ["optimizer_state", "collective_corruption"])
def test_with_a_bit_the_update_faults_flip_it_in_count_elements_of_one_tensor_once_per_step(kind: str) -> None:
    """SDC in the optimizer's memory or a reduction's result: bit 30 (fp32's exponent MSB) of 3 elements of one
    stepped tensor, once per step even when the hook runs per parameter group; the same draw for the same (seed,
    step); every other element bitwise unchanged."""
    model, batch, clock = make_model(), tokens(), Clock()
    optimizer = adam_with_state(model, batch)

    def targets() -> list[torch.Tensor]:
        if kind == "optimizer_state":
            return [optimizer.state[p]["exp_avg"] for p in model.parameters()]
        return [p.grad for p in model.parameters()]

    before = [t.clone() for t in targets()]
    faults = injector(clock, kind=kind, rank=0, step=1, bit=30, count=3, seed=7)
    clock.step = 1
    faults.before_update(optimizer.param_groups, optimizer.state)
    faults.before_update(optimizer.param_groups, optimizer.state)  # a second call in the step: no second flip
    changed = [(i, (t != b).sum().item()) for i, (t, b) in enumerate(zip(targets(), before, strict=True))
               if not torch.equal(t, b)]
    assert len(changed) == 1 and changed[0][1] == 3, changed
    index = changed[0][0]
    words = targets()[index].view(torch.int32) ^ before[index].view(torch.int32)
    assert set(words[words != 0].tolist()) == {1 << 30}
    assert faults.fired == [(1, kind)]
    for tensor, original in zip(targets(), before, strict=True):  # reset; the same seed and step: the same tensor
        tensor.copy_(original)
    at_one = Clock()
    at_one.step = 1
    again = injector(at_one, kind=kind, rank=0, step=1, bit=30, count=3, seed=7)
    again.before_update(optimizer.param_groups, optimizer.state)
    assert [i for i, (t, b) in enumerate(zip(targets(), before, strict=True)) if not torch.equal(t, b)] == [index]


# ---------------------------------------------------------------------------------------------- hardware_events


def test_hardware_events_reports_count_per_active_step_attempt() -> None:
    clock = Clock()
    faults = injector(clock, kind="hardware_events", rank=0, step=1, steps=2, count=5)
    assert faults.reports_events and not faults.acts_before_update
    reported = []
    for step in range(4):
        clock.step = step
        reported.append(faults.system_events())
    assert reported == [0, 5, 5, 0]
    assert injector(Clock(), kind="hardware_events", rank=0, step=0).system_events() == 1


# ------------------------------------------------------------------------------------------------ config errors


@pytest.mark.parametrize(("override", "key", "allowed"), [
    ("{kind: grad_scale, rank: 0, step: 1, rate: 0}", "rate", "a fraction in (0, 1]"),
    ("{kind: weight_corruption, rank: 0, step: 1, rate: 1.5}", "rate", "a fraction in (0, 1]"),
    ("{kind: grad_scale, rank: 0, step: 1, noise: -1}", "noise", "must be >= 0"),
    ("{kind: memory_leak, rank: 0, step: 1, megabytes: 0}", "megabytes", "a finite number > 0"),
    ("{kind: optimizer_state, rank: 0, step: 1, state_key: momentum}", "state_key", "'exp_avg', 'exp_avg_sq'"),
    ("{kind: hardware_events, rank: 0, step: 1, count: 0}", "count", "an integer >= 1"),
])
def test_bad_state_fault_configs_name_the_key_and_what_is_allowed(override: str, key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(None, [f"faults.injections=[{override}]"])
    assert raised.value.key == f"faults.injections[0].{key}"
    assert allowed in str(raised.value)


def test_state_key_is_checked_in_python_too_and_bitflip_keys_stay_valid() -> None:
    with pytest.raises(ConfigError, match="state_key"):
        FaultSpec(kind="optimizer_state", rank=0, step=0, state_key="momentum")  # type: ignore[arg-type]
    FaultSpec(kind="bitflip", rank=0, step=0, pattern="head", rate=1.0)
    FaultSpec(kind="bitflip", rank=0, step=0, pattern="head", count=16)


# ------------------------------------------------------------------------------------ through arc_engine.attach


class ExplodingGroup(dict):
    """A parameter group that fails on any read: heal_step must not look into it."""

    def __getitem__(self, key: object) -> Any:
        raise AssertionError(f"heal_step read param_groups[...][{key!r}]")


def train(tmp_path: Path, steps: int, *overrides: str, forwards: int = 1) -> tuple[Any, list[list[torch.Tensor]]]:
    """The tiny GPT with AdamW and arc_engine attached for ``steps`` steps (``forwards`` forward passes per step,
    the last one trained on); returns the arc and the parameters after each step."""
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(model, optimizer, make_config(tmp_path, *overrides))
    after = []
    for _ in range(steps):
        for _ in range(forwards):
            loss = model(*data.batch(arc.progress.step, 0, BATCH))
        arc.record_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after.append([p.detach().clone() for p in model.parameters()])
    arc.close()
    return arc, after


def test_optimizer_state_at_step_k_changes_the_run_from_step_k_only(tmp_path: Path) -> None:
    _, clean = train(tmp_path / "clean", 5)
    arc, faulted = train(tmp_path / "fault", 5, "faults.injections=[{kind: optimizer_state, rank: 0, step: 3, "
                                                "scale: 5.0}]")
    for step in range(3):
        assert all(torch.equal(a, b) for a, b in zip(clean[step], faulted[step], strict=True)), step
    for step in (3, 4):
        assert not all(torch.equal(a, b) for a, b in zip(clean[step], faulted[step], strict=True)), step
    assert arc.faults.fired == [(3, "optimizer_state")]


def test_update_hook_only_for_an_update_fault_and_inactive_it_reads_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = FaultInjector.before_update
    monkeypatch.setattr(FaultInjector, "before_update",
                        lambda self, groups, state=None: calls.append(1) or original(self, groups, state))
    arc, _ = train(tmp_path / "none", 2, "faults.injections=[{kind: optimizer_state, rank: 1, step: 0}]")
    assert arc.engine.update_hooks == [] and arc.engine.event_sources == [] and calls == []
    arc, _ = train(tmp_path / "later", 2, "faults.injections=[{kind: collective_corruption, rank: 0, step: 9}, "
                                          "{kind: optimizer_state, rank: 0, step: 9}]")
    assert len(arc.engine.update_hooks) == 1 and len(calls) == 2  # one call per applied step
    assert heal_step(arc.engine, [ExplodingGroup()], {}) is None  # inactive: not one parameter list read
    assert arc.faults.fired == []


def test_hardware_events_reach_the_engine_once_per_step_attempt(tmp_path: Path) -> None:
    model, data = tiny_model_and_data()
    optimizer = make_optimizer(model)
    arc = arc_engine.attach(model, optimizer, make_config(
        tmp_path, "faults.injections=[{kind: hardware_events, rank: 0, step: 2, steps: 3, count: 4}]"))
    assert len(arc.engine.event_sources) == 1
    counted = []
    for _ in range(6):
        for _ in range(2):  # two micro-batches: the step starts once
            loss = model(*data.batch(arc.progress.step, 0, BATCH))
            arc.record_loss(loss)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        counted.append(arc.engine.local_events)
    arc.close()
    assert counted == [0, 0, 4, 8, 12, 12]


def test_data_and_weight_faults_act_through_attach(tmp_path: Path) -> None:
    _, clean = train(tmp_path / "clean", 3)
    arc, faulted = train(tmp_path / "fault", 3, "faults.injections=[{kind: data_corruption, rank: 0, step: 1, "
                                                "rate: 0.5}, {kind: weight_corruption, rank: 0, step: 2, "
                                                "pattern: 'tok_emb.weight', scale: 0.0, rate: 0.3}]", forwards=2)
    assert all(torch.equal(a, b) for a, b in zip(clean[0], faulted[0], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(clean[1], faulted[1], strict=True))
    assert arc.faults.fired == [(1, "data_corruption"), (2, "weight_corruption")]
