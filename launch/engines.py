"""Command line and environment of one engine worker, per engine (sim, SGLang, vLLM).

Pure functions of the configuration: the local launcher and the Ray worker actors both call
:func:`engine_command`, so a worker is started the same way wherever it runs. Each real engine runs from
its own venv (``.venv-sglang``, ``.venv-vllm``), as users run them; ``--engine-python`` overrides that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.launch.config import SGLANG_POLICY_CONFIG_FLAG, ClusterConfig, split_sglang_policy_config

# the source tree (the folder holding launch/), where scripts/install_*_env.sh put the engine venvs
SOURCE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class EngineCommand:
    """How to start one worker: argv, environment additions, and the CPU core it is pinned to (or None)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cpu_core: int | None = None
    health_path: str = "/health"


def default_engine_python(engine: str) -> str:
    """``.venv-<engine>/bin/python`` (current directory first, then the source tree) or this Python."""
    if engine == "sim":
        return sys.executable
    for root in (Path.cwd(), SOURCE_ROOT):
        candidate = root / f".venv-{engine}" / "bin" / "python"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return sys.executable


def gpu_ids() -> list[str]:
    """CUDA device ids this host lets us use: CUDA_VISIBLE_DEVICES when set, else every GPU nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def count_gpus() -> int:
    """NVIDIA GPUs usable on this host (0 without nvidia-smi)."""
    return len(gpu_ids())


def resolve_device(cfg: ClusterConfig) -> str:
    """'gpu' or 'cpu'. The simulator never uses a GPU; 'auto' means gpu when this host has one."""
    if cfg.engine == "sim":
        return "cpu"
    if cfg.device != "auto":
        return cfg.device
    return "gpu" if count_gpus() > 0 else "cpu"


def usable_cores() -> list[int]:
    """CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def engine_command(
    cfg: ClusterConfig,
    index: int,
    port: int,
    *,
    device: str,
    python: str | None = None,
    gpu: str | None = None,
    cores: list[int] | None = None,
) -> EngineCommand:
    """Command for worker ``index`` listening on ``port``.

    ``gpu``: the CUDA device id for this worker (None: leave CUDA_VISIBLE_DEVICES alone, e.g. when Ray
    has set it). On CPU, real engines get one core each (``cores[index % len(cores)]``); the simulator is
    not pinned, it only sleeps on the wall clock.
    """
    if port <= 0 or port > 65535:
        raise ValueError(f"port must be in 1..65535, got {port}")
    py = python or cfg.engine_python or default_engine_python(cfg.engine)
    host = cfg.worker_host
    env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
    core: int | None = None
    if device == "gpu" and gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if device == "cpu" and cfg.engine != "sim":
        pool = cores if cores else usable_cores()
        core = pool[index % len(pool)]
    extra = list(cfg.engine_args)

    if cfg.engine == "sim":
        argv = [
            py,
            "-m",
            "kvroute.launch.cli",
            "worker",
            "--engine",
            "sim",
            "--host",
            host,
            "--port",
            str(port),
            "--eviction",
            cfg.eviction,
        ]
        if cfg.preset:
            argv += ["--preset", cfg.preset]
    elif cfg.engine == "sglang":
        argv = [
            py,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(cfg.model),
            "--host",
            host,
            "--port",
            str(port),
            "--radix-eviction-policy",
            "rlt" if cfg.eviction == "rlt-leaf" else cfg.eviction,
        ]
        if cfg.eviction == "rlt-leaf":
            # the plugin's rlt with unit=leaf; a policy config the user gave after -- is merged into
            # the one flag (ClusterConfig already rejected a config asking for another unit)
            extra, user = split_sglang_policy_config(extra)
            argv += [SGLANG_POLICY_CONFIG_FLAG, json.dumps({**(user or {}), "unit": "leaf"})]
        if device == "cpu":
            argv += ["--device", "cpu"]
            env["SGLANG_CPU_OMP_THREADS_BIND"] = str(core)
    elif cfg.engine == "vllm":
        argv = [
            py,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(cfg.model),
            "--host",
            host,
            "--port",
            str(port),
        ]
        env["KVROUTE_EVICTION"] = cfg.eviction  # vLLM's CLI cannot be extended by a plugin (DESIGN §3)
        if device == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    else:  # unreachable after validation; kept so a new engine name fails loudly
        raise ValueError(f"unknown engine {cfg.engine!r}")
    return EngineCommand(argv=argv + extra, env=env, cpu_core=core)
