"""``kvroute sim``: every eviction the simulator models is accepted and reported; anything else exits 2."""

from __future__ import annotations

import json

import pytest
from kvroute.bench import sim_cli
from kvroute.sim.engine import EVICTIONS


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_sim_runs_each_eviction(eviction: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "gsp", "--policy", "round_robin", "--eviction", eviction, "--json", "-"]
    assert sim_cli.main([*argv, "--option", "groups=4", "--option", "queries_per_group=8"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["eviction"] == eviction
    assert (row["requests"], row["errors"]) == (32, 0)
    assert 0.0 <= row["hit_rate"] <= 1.0


def test_sim_rejects_an_unknown_eviction(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        sim_cli.main(["--eviction", "fifo"])
    assert info.value.code == 2
    assert "rlt-leaf" in capsys.readouterr().err  # the message lists the valid choices
