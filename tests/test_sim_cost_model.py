"""kvroute.sim.cost_model: the roofline step time, checked against hand-computed answers."""

from __future__ import annotations

import math

import pytest
from kvroute.sim.cost_model import CPU_PRESET_NAME, PRESETS, CostModel, get_preset


def test_presets_exist_with_sources() -> None:
    for name in ("l40-llama3.1-8b", "h200-llama3.1-70b-fp8"):
        model = PRESETS[name]
        assert model.name == name
        assert {"model", "hardware", "efficiency"} <= set(model.sources)


def test_l40_llama8b_known_answers() -> None:
    m = get_preset("l40-llama3.1-8b")
    # Published figures: 8.03e9 params, 128256 x 4096 embedding, 32 layers, 8 KV heads x 128, BF16.
    matmul = 8.03e9 - 128256 * 4096
    assert m.matmul_params == pytest.approx(matmul)
    assert m.kv_bytes_per_token == 131072
    assert m.weight_bytes == pytest.approx(16.06e9)
    # Prefill 1000 tokens from an empty context: compute bound.
    flops = 2 * matmul * 1000 + 4 * 32 * 4096 * (1000 * 1001 / 2)
    expect = 0.002 + flops / (181.05e12 * 0.5)
    assert m.step_time([(1000, 0)]) == pytest.approx(expect, rel=1e-12)
    assert m.step_time([(1000, 0)]) == pytest.approx(0.1707, abs=5e-4)
    # One decode token at context 1000: memory bound (weights + 1001 tokens of KV).
    mem = (16.06e9 + 1001 * 131072) / (864e9 * 0.7)
    assert m.step_time((), [1000]) == pytest.approx(0.002 + mem, rel=1e-12)


def test_h200_70b_fp8_known_answer() -> None:
    m = get_preset("h200-llama3.1-70b-fp8")
    assert m.weight_bytes == pytest.approx(70.6e9)  # one byte per FP8 weight
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    mem = (70.6e9 + 513 * m.kv_bytes_per_token) / (4.8e12 * 0.7)
    assert m.step_time((), [512]) == pytest.approx(0.002 + mem, rel=1e-12)


def test_prefix_context_and_batch_cost_more() -> None:
    m = get_preset("l40-llama3.1-8b")
    assert m.step_time() == 0.0
    assert m.step_time([(512, 4096)]) > m.step_time([(512, 0)])  # attention over the cached prefix
    assert m.step_time([(2048, 0)]) > 2 * m.step_time([(1024, 0)]) - m.step_overhead_s
    one = m.step_time((), [1000])
    many = m.step_time((), [1000] * 64)
    assert one < many < 64 * one  # batching decode amortises the weight reads
    mixed = m.step_time([(1024, 0)], [1000] * 8)
    assert mixed >= m.step_time([(1024, 0)])


def test_bad_presets_and_fields() -> None:
    with pytest.raises(ValueError, match="unknown cost-model preset"):
        get_preset("a100-nonsense")
    with pytest.raises(TypeError):
        get_preset(3)  # type: ignore[arg-type]
    base = get_preset("l40-llama3.1-8b")
    with pytest.raises(ValueError):
        base.with_overrides(compute_efficiency=1.5)
    with pytest.raises(ValueError):
        base.with_overrides(peak_flops=math.nan)
    with pytest.raises(ValueError):
        base.with_overrides(step_overhead_s=-1.0)
    assert isinstance(base.with_overrides(step_overhead_s=0.0), CostModel)


def test_cpu_preset_is_measured_or_refused() -> None:
    if CPU_PRESET_NAME in PRESETS:
        m = PRESETS[CPU_PRESET_NAME]
        assert "measured" in m.sources["hardware"]
        assert m.step_time([(128, 0)]) > 0
    else:  # never a guessed number: an unmeasured preset is an error that says how to measure it
        with pytest.raises(ValueError, match="measure_cpu_preset"):
            get_preset(CPU_PRESET_NAME)


def test_measure_script_refuses_what_it_cannot_measure(tmp_path, capsys) -> None:
    from kvroute.bench import measure_cpu_preset

    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text(
        '{"hidden_size": 128, "num_hidden_layers": 2, "num_key_value_heads": 2}'
    )
    assert measure_cpu_preset.main(["--model", str(other), "--vllm-python", "/bin/true"]) == 2
    assert "not SmolLM2-135M" in capsys.readouterr().err
    assert measure_cpu_preset.main(["--model", str(other), "--vllm-python", str(tmp_path / "missing")]) == 2
    assert "install_vllm_env" in capsys.readouterr().err
    assert measure_cpu_preset.main(["--model", str(other), "--dtype", "int3"]) == 2


def test_measure_fit_recovers_a_known_line() -> None:
    from kvroute.bench.measure_cpu_preset import _fit_line

    xs = [1e9, 2e9, 4e9, 8e9]
    a, b = _fit_line(xs, [0.01 + x / 5e10 for x in xs])
    assert a == pytest.approx(0.01) and 1 / b == pytest.approx(5e10)
