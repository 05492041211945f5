"""kvroute.sim: the engine model, the cost model and the discrete-event cluster simulator.

Attributes are imported lazily so that ``kvroute.sim.tokenizer`` (used by workloads and the live
benchmark) does not pull in the cache core and the router.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "EngineModel": "kvroute.sim.engine",
    "StepResult": "kvroute.sim.engine",
    "FinishedRequest": "kvroute.sim.engine",
    "ClusterSim": "kvroute.sim.cluster",
    "SimResult": "kvroute.sim.cluster",
    "RequestRecord": "kvroute.sim.cluster",
    "CostModel": "kvroute.sim.cost_model",
    "PRESETS": "kvroute.sim.cost_model",
    "get_preset": "kvroute.sim.cost_model",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvroute.sim' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
