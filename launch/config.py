"""What a cluster launch needs, validated once: the ``kvroute launch`` flags and ``--config cluster.yaml``.

A YAML file uses the same names as the flags (``health_timeout_s`` or ``health-timeout-s``); flags given
on the command line override the file. Every value is checked here by pydantic, so the launcher below
never sees a half-valid configuration; :func:`describe_errors` turns a ``ValidationError`` into one line
per bad field for the CLI (exit code 2).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Engine = Literal["sim", "sglang", "vllm"]
# rlt-leaf: RLT's marking with whole-leaf draws; SGLang only (--radix-eviction-policy rlt with the
# policy config {"unit": "leaf"}), and the simulator
Eviction = Literal["lru", "rlt", "rlt-leaf"]
SGLANG_POLICY_FLAG = "--radix-eviction-policy"
SGLANG_POLICY_CONFIG_FLAG = "--radix-eviction-policy-config"
Device = Literal["auto", "cpu", "gpu"]


class ConfigFileError(ValueError):
    """The --config file cannot be read or is not a YAML mapping."""


class ClusterConfig(BaseModel):
    """One cluster: N workers of one engine behind one router.

    Invariants after validation: ``model`` is set for real engines; ``engine_python``, when given, is an
    executable file; ``bench_rate`` / ``bench_num`` / ``bench_args`` are only set together with ``bench``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    workers: int = Field(4, ge=1, le=512, description="number of engine workers")
    engine: Engine = Field("sim", description="sim (no GPU needed), sglang or vllm")
    model: str | None = Field(None, description="model path or name (sglang, vllm)")
    eviction: Eviction = Field("lru", description="KV-cache eviction inside each engine")
    policy: str = Field("lbgr", min_length=1, description="router policy")
    host: str = Field("127.0.0.1", min_length=1, description="router bind address")
    port: int = Field(8000, ge=0, le=65535, description="router port (0: any free port)")
    worker_host: str = Field("127.0.0.1", min_length=1, description="bind address of the workers")
    device: Device = Field("auto", description="gpu: one GPU per worker; cpu: one core per worker")
    engine_python: str | None = Field(None, description="python that runs the engine")
    engine_args: list[str] = Field(default_factory=list, description="extra engine flags (after --)")
    router_args: list[str] = Field(default_factory=list, description="extra `kvroute router` flags")
    preset: str | None = Field(None, min_length=1, description="sim cost-model preset")
    admin_token: str | None = Field(None, min_length=1, description="token for the router's /workers")
    log_dir: str | None = Field(None, description="directory for one log file per process")
    health_timeout_s: float = Field(600.0, gt=0, description="how long workers may take to become healthy")
    ray: str | None = Field(None, min_length=1, description="'auto' or a Ray GCS address host:port")
    cluster_name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="membership name on Ray")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPU bundle per worker on Ray (device cpu)")
    bench: str | None = Field(None, min_length=1, description="run `kvroute bench serve` with this workload")
    bench_rate: float | None = Field(None, gt=0, description="request rate for --bench (req/s)")
    bench_num: int | None = Field(None, ge=1, description="number of requests for --bench")
    bench_args: list[str] = Field(default_factory=list, description="extra `kvroute bench serve` flags")

    @field_validator("engine_python")
    @classmethod
    def _python_is_executable(cls, value: str | None) -> str | None:
        if value is not None and not (Path(value).is_file() and os.access(value, os.X_OK)):
            raise ValueError(f"not an executable file: {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        if self.engine != "sim" and not self.model:
            raise ValueError(f"model: engine '{self.engine}' needs a model (--model PATH)")
        if self.engine == "sim" and self.model:
            raise ValueError("model: engine 'sim' takes no model; use --preset to choose its cost model")
        if self.preset and self.engine != "sim":
            raise ValueError("preset: only applies to engine 'sim'")
        if self.eviction == "rlt-leaf" and self.engine == "vllm":
            raise ValueError(
                "eviction: rlt-leaf is SGLang-only (a draw evicts a whole radix leaf); vLLM's RLT draws "
                "per block: use --eviction rlt with vllm"
            )
        if self.engine == "sglang" and any(
            a == SGLANG_POLICY_FLAG or a.startswith(SGLANG_POLICY_FLAG + "=") for a in self.engine_args
        ):
            # launch sets SGLang's policy from `eviction`; a second one after -- would silently win
            raise ValueError(
                f"engine_args: {SGLANG_POLICY_FLAG} is set by kvroute from --eviction "
                f"(here {self.eviction!r}); drop it from the engine arguments"
            )
        if self.eviction == "rlt-leaf" and self.engine == "sglang":
            _, user = split_sglang_policy_config(self.engine_args)  # raises on a malformed flag
            if user is not None and user.get("unit", "leaf") != "leaf":
                raise ValueError(
                    f"engine_args: {SGLANG_POLICY_CONFIG_FLAG} sets unit={user['unit']!r}, but eviction "
                    "rlt-leaf means unit 'leaf' (use --eviction rlt for page draws)"
                )
        if self.bench is None and (
            self.bench_rate is not None or self.bench_num is not None or self.bench_args
        ):
            raise ValueError("bench: bench_rate, bench_num and bench_args need bench (a workload name)")
        return self


def split_sglang_policy_config(engine_args: list[str]) -> tuple[list[str], dict[str, Any] | None]:
    """``engine_args`` without SGLang's ``--radix-eviction-policy-config`` flags, and the JSON object the
    last of them holds (SGLang's parser keeps the last one too), or None when there is none.

    ValueError naming ``engine_args`` when the flag has no value, or its value is not a JSON object."""
    rest: list[str] = []
    value: str | None = None
    i = 0
    while i < len(engine_args):
        arg = engine_args[i]
        if arg == SGLANG_POLICY_CONFIG_FLAG:
            if i + 1 >= len(engine_args):
                raise ValueError(f"engine_args: {SGLANG_POLICY_CONFIG_FLAG} needs a JSON object after it")
            value = engine_args[i + 1]
            i += 2
            continue
        if arg.startswith(SGLANG_POLICY_CONFIG_FLAG + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if value is None:
        return rest, None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"engine_args: {SGLANG_POLICY_CONFIG_FLAG} is not valid JSON ({exc.msg}): {value!r}"
        ) from None
    if not isinstance(parsed, dict):
        raise ValueError(f"engine_args: {SGLANG_POLICY_CONFIG_FLAG} must be a JSON object, got {value!r}")
    return rest, parsed


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a cluster YAML file into a flat dict with underscore keys."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(
            f"config file {path} must hold a mapping of settings, got {type(data).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigFileError(f"config file {path}: setting names must be strings, got {key!r}")
        out[key.replace("-", "_")] = value
    return out


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> ClusterConfig:
    """Flags that were given (not None) override the file; pydantic validates the merge."""
    merged = dict(file_values)
    merged.update({k: v for k, v in flag_values.items() if v is not None})
    return ClusterConfig.model_validate(merged)


def describe_errors(exc: ValidationError) -> str:
    """One line per invalid field: ``field: problem (got value)``."""
    lines = []
    for err in exc.errors():
        message = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a cross-field rule: its message starts with the field it is about
            lines.append(message)
            continue
        field = ".".join(str(part) for part in err["loc"])
        got = f" (got {err['input']!r})" if err["type"] != "missing" else ""
        lines.append(f"{field}: {message}{got}")
    return "\n".join(lines)
