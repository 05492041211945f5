"""kvroute.router: the routing core (prefix index, cluster state, policies) behind the ``Router`` facade.

Pure code — no I/O, threads or clock; the HTTP proxy (``kvroute.router.server``) and the simulator both
drive ``Router`` and tell it the time.
"""

from kvroute.cython_ext.prefix_index import PrefixIndex
from kvroute.router.core import Router
from kvroute.router.policies import POLICY_NAMES, make_policy
from kvroute.router.types import NoWorkerAvailable, Policy, Request, WorkerView

__all__ = [
    "POLICY_NAMES",
    "NoWorkerAvailable",
    "Policy",
    "PrefixIndex",
    "Request",
    "Router",
    "WorkerView",
    "make_policy",
]
