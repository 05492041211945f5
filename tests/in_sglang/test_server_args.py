"""(a) ``rlt`` is a choice of SGLang's own ``--radix-eviction-policy`` once the plugin is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest


def test_entry_point_is_installed() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kvroute") == "kvroute.engine_patches.sglang:register"


def test_sglang_parser_accepts_rlt(sglang_plugin: None) -> None:
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "dummy", "--radix-eviction-policy", "rlt"])
    assert args.radix_eviction_policy == "rlt"
    lru = prepare_server_args(["--model-path", "dummy"])
    assert lru.radix_eviction_policy == "lru"  # the default stays SGLang's


def test_sglang_parser_still_rejects_unknown_policy(sglang_plugin: None) -> None:
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(SystemExit) as exc:
        prepare_server_args(["--model-path", "dummy", "--radix-eviction-policy", "not-a-policy"])
    assert exc.value.code == 2


def test_register_is_idempotent(sglang_plugin: None) -> None:
    from kvroute.engine_patches import sglang as plugin
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
    from sglang.srt.plugins.hook_registry import HookRegistry

    for _ in range(3):
        plugin.register()
    assert RADIX_EVICTION_POLICY_CHOICES.count("rlt") == 1
    for target in (plugin.RADIX_CACHE_INIT, plugin.UNIFIED_RADIX_CACHE_INIT):
        ours = [h for _, h, _ in HookRegistry._hooks[target] if h.__module__ == plugin.__name__]
        assert len(ours) == 1, target


def test_without_the_plugin_sglang_rejects_rlt(sglang_plugin: None) -> None:
    """SGLANG_PLUGINS whitelists general plugins: with kvroute left out, ``rlt`` is an invalid choice,
    so it is the plugin (loaded by SGLang's launcher path) that adds it."""
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins();"
        "from sglang.srt.server_args import prepare_server_args;"
        "prepare_server_args(['--model-path', 'dummy', '--radix-eviction-policy', 'rlt'])"
    )
    env = {**os.environ, "SGLANG_PLUGINS": "some-other-plugin"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "invalid choice: 'rlt'" in proc.stderr
