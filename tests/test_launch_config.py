"""`kvroute launch` configuration: flags and YAML are the same thing, bad values name their field (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvroute.launch import launcher
from kvroute.launch.config import ClusterConfig, ConfigFileError, build_config, describe_errors, load_yaml
from pydantic import ValidationError


def test_yaml_equals_flags(tmp_path: Path) -> None:
    flags = [
        "--workers",
        "3",
        "--engine",
        "vllm",
        "--model",
        "m",
        "--eviction",
        "rlt",
        "--policy",
        "lbgr",
        "--port",
        "0",
        "--health-timeout",
        "12",
        "--bench",
        "gsp",
        "--rate",
        "2.5",
        "--num",
        "7",
        "--",
        "--max-model-len",
        "512",
    ]
    (tmp_path / "c.yaml").write_text(
        "workers: 3\nengine: vllm\nmodel: m\neviction: rlt\npolicy: lbgr\nport: 0\n"
        "health-timeout-s: 12\nbench: gsp\nbench_rate: 2.5\nbench_num: 7\n"
        "engine_args: ['--max-model-len', '512']\n"
    )
    from_flags = launcher.parse_config(flags)
    from_file = launcher.parse_config(["--config", str(tmp_path / "c.yaml")])
    assert from_flags == from_file
    assert from_flags.engine_args == ["--max-model-len", "512"]
    assert from_flags.health_timeout_s == 12.0


def test_flags_override_file(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("workers: 3\neviction: rlt\n")
    cfg = launcher.parse_config(["--config", str(tmp_path / "c.yaml"), "--workers", "5"])
    assert (cfg.workers, cfg.eviction) == (5, "rlt")


def test_example_cluster_yaml_is_valid() -> None:
    path = Path(__file__).resolve().parent.parent / "examples" / "cluster.yaml"
    cfg = build_config(load_yaml(path), {})
    assert cfg.workers == 4 and cfg.eviction == "rlt" and cfg.policy == "lbgr"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"workers": 0}, "workers"),
        ({"workers": "many"}, "workers"),
        ({"engine": "tgi"}, "engine"),
        ({"eviction": "fifo"}, "eviction"),
        ({"port": 70000}, "port"),
        ({"health_timeout_s": 0}, "health_timeout_s"),
        ({"engine": "vllm"}, "model"),  # a real engine needs a model
        ({"model": "x"}, "model"),  # the simulator takes none
        ({"engine_python": "/nonexistent/python"}, "engine_python"),
        ({"bench_rate": 3}, "bench"),  # a rate without a workload
        ({"cluster_name": "a b"}, "cluster_name"),
        ({"wrokers": 2}, "wrokers"),  # typo: unknown setting
        ({"eviction": "rlt_leaf"}, "eviction"),
        # rlt-leaf is SGLang's unit=leaf: vLLM's RLT draws per block
        ({"engine": "vllm", "model": "m", "eviction": "rlt-leaf"}, "eviction"),
        # a user policy config after -- that contradicts rlt-leaf, or that SGLang could not read
        (
            {
                "engine": "sglang",
                "model": "m",
                "eviction": "rlt-leaf",
                "engine_args": ["--radix-eviction-policy-config", '{"unit": "page"}'],
            },
            "engine_args",
        ),
        (
            {
                "engine": "sglang",
                "model": "m",
                "eviction": "rlt-leaf",
                "engine_args": ["--radix-eviction-policy-config=[1]"],
            },
            "engine_args",
        ),
        (
            {
                "engine": "sglang",
                "model": "m",
                "eviction": "rlt-leaf",
                "engine_args": ["--radix-eviction-policy-config", "{seed: 1}"],
            },
            "engine_args",
        ),
        (
            {
                "engine": "sglang",
                "model": "m",
                "eviction": "rlt-leaf",
                "engine_args": ["--radix-eviction-policy-config"],
            },
            "engine_args",
        ),
        # SGLang's policy comes from --eviction; a second one after -- would silently override it
        (
            {"engine": "sglang", "model": "m", "engine_args": ["--radix-eviction-policy", "lfu"]},
            "engine_args",
        ),
        ({"engine": "sglang", "model": "m", "engine_args": ["--radix-eviction-policy=lru"]}, "engine_args"),
    ],
)
def test_invalid_value_names_field(values: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        ClusterConfig.model_validate(values)
    assert describe_errors(info.value).startswith(f"{field}:")


def test_cli_invalid_value_exits_2_naming_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c.yaml").write_text("workers: -1\n")
    assert launcher.main(["--config", str(tmp_path / "c.yaml")]) == 2
    assert "workers:" in capsys.readouterr().err
    assert launcher.main(["--policy", "no-such-policy"]) == 2
    err = capsys.readouterr().err
    assert "policy" in err and "lbgr" in err  # names the field and lists the valid choices
    with pytest.raises(SystemExit) as info:  # argparse: a non-integer
        launcher.main(["--workers", "four"])
    assert info.value.code == 2


def test_rlt_leaf_choices_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.parse_config(["--eviction", "rlt-leaf"]).eviction == "rlt-leaf"
    cfg = launcher.parse_config(["--engine", "sglang", "--model", "m", "--eviction", "rlt-leaf"])
    assert (cfg.engine, cfg.eviction) == ("sglang", "rlt-leaf")
    assert launcher.main(["--engine", "vllm", "--model", "m", "--eviction", "rlt-leaf"]) == 2
    err = capsys.readouterr().err
    assert "eviction: rlt-leaf is SGLang-only" in err and "--eviction rlt" in err
    argv = ["--engine", "sglang", "--model", "m", "--eviction", "rlt-leaf", "--"]
    assert launcher.main([*argv, "--radix-eviction-policy-config", '{"unit": "page"}']) == 2
    assert "unit='page'" in capsys.readouterr().err


def test_bad_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="cannot read"):
        load_yaml(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigFileError, match="mapping"):
        load_yaml(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("workers: [1\n")
    with pytest.raises(ConfigFileError, match="not valid YAML"):
        load_yaml(tmp_path / "bad.yaml")
    assert launcher.main(["--config", str(tmp_path / "bad.yaml")]) == 2
