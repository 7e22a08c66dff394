"""Which monitor families exist: the built-ins, then the plugins registered by the user, in order.

Every rank must see the same families in the same order (the statistics layout is checked across ranks at attach).
"""

from __future__ import annotations

from arc_engine.monitors.family import FamilyBase

_plugins: list[FamilyBase] = []


def builtin_families() -> list[FamilyBase]:
    """The families that ship with arc_engine, in the order their monitors run."""
    from arc_engine.monitors.bad_data import BadDataFamily
    from arc_engine.monitors.conformal import ConformalFamily
    from arc_engine.monitors.consistency import ConsistencyFamily
    from arc_engine.monitors.dynamics import DynamicsFamily
    from arc_engine.monitors.fisher import FisherFamily
    from arc_engine.monitors.loss_spike import LossSpikeFamily
    from arc_engine.monitors.non_finite import NonFiniteFamily
    from arc_engine.monitors.numerics import GradNormFamily
    from arc_engine.monitors.optimizer import OptimizerStatsFamily
    from arc_engine.monitors.qk_spectra import QKSpectraFamily
    from arc_engine.monitors.r_metric import RMetricFamily
    from arc_engine.monitors.router_health import RouterFamily
    from arc_engine.monitors.sdc import SDCFamily
    from arc_engine.monitors.straggler import StragglerFamily
    from arc_engine.monitors.weight_health import WeightHealthFamily

    return [NonFiniteFamily(), LossSpikeFamily(), GradNormFamily(), SDCFamily(), OptimizerStatsFamily(),
            QKSpectraFamily(), RouterFamily(), ConsistencyFamily(), BadDataFamily(), StragglerFamily(), RMetricFamily(),
            WeightHealthFamily(), DynamicsFamily(), ConformalFamily(), FisherFamily()]


def register_family(family: FamilyBase) -> None:
    """Add a plugin family (before loading the config that configures it, and before attach; on every rank).
    Registering a family of the same name again replaces it. Raises ValueError for a name a built-in uses or that
    is not a plain identifier, and for a family without a ``config_class``."""
    if not isinstance(family, FamilyBase):
        raise TypeError(f"register_family: {family!r} is not a FamilyBase (subclass "
                        "arc_engine.monitors.family.FamilyBase and override what the family brings)")
    if not family.name.isidentifier() or family.name in {f.name for f in builtin_families()} \
            or family.name == "plugins":
        raise ValueError(f"register_family: {family.name!r} is not allowed as a family name (a Python identifier "
                         "that no built-in family uses)")
    if family.config_class is None:
        raise ValueError(f"register_family: family {family.name!r} needs a config_class (the dataclass of its "
                         f"detectors.{family.name} section)")
    unregister_family(family.name)
    _plugins.append(family)


def unregister_family(name: str) -> None:
    """Remove the plugin family ``name`` (no-op when absent)."""
    _plugins[:] = [f for f in _plugins if f.name != name]


def families() -> list[FamilyBase]:
    """The built-in families, then the registered plugins."""
    return [*builtin_families(), *_plugins]


def section_class(name: str) -> type | None:
    """The config dataclass of family ``name`` (built-in or plugin: ``detectors.<name>`` is parsed with it and kept
    in ``detectors.plugins``); None for a family without a section or no such family."""
    return next((f.config_class for f in families() if f.name == name and f.config_class is not None), None)


def sectioned_names() -> list[str]:
    """The families that bring their own config class, built-ins first."""
    return [f.name for f in families() if f.config_class is not None]


def plugin_names() -> list[str]:
    return [f.name for f in _plugins]
