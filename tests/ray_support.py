"""A private local Ray cluster for one test module: its own ray.init / ray.shutdown, never `ray stop`."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from kvroute.router import ray_membership


@contextmanager
def local_ray_cluster(num_cpus: int) -> Iterator[str]:
    """Start Ray in this process (the cluster's first driver) and yield its GCS address."""
    tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # short: Ray's socket paths have a length limit
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = tmp  # DESIGN.md §7: Ray's temp dir and TMPDIR together
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace=ray_membership.NAMESPACE,
        _temp_dir=tmp,
        logging_level=logging.WARNING,
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
