"""Build a random-weight tiny Llama with a locally trained byte-level BPE tokenizer (no downloads).

The result is a Hugging Face model directory (config.json, model.safetensors, tokenizer.json, ...) that
vLLM serves like any Llama: it exists so tests and demos can start a real engine in seconds on a CPU.
Its outputs are meaningless (random weights); token counts, prefix caching and scheduling are real.

Training text is local: pseudo-words built from syllables (the same shape of text the simulator's
workloads produce) plus the docstrings of Python's standard library. Byte-level BPE means any text,
whatever its characters, encodes without unknown tokens.

    python scripts/make_tiny_llama.py --out models/tiny-llama
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
# A minimal chat template so /v1/chat/completions works too.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
STDLIB_MODULES = [
    "argparse", "collections", "json", "os", "pathlib", "random", "re", "statistics", "string",
    "textwrap", "unittest", "urllib.parse", "http.client", "email.message", "logging",
]  # fmt: skip


def syllable_words(n_words: int, seed: int) -> list[str]:
    """Pronounceable pseudo-words (1-3 syllables), deterministic for a seed."""
    rng = random.Random(seed)
    consonants, vowels, codas = "bdfghjklmnprstvwz", "aeiou", ["", "", "n", "r", "s", "t"]
    syllables = [c + v + k for c in consonants for v in vowels for k in codas]
    return ["".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3)))) for _ in range(n_words)]


def training_text(seed: int) -> Iterator[str]:
    """Lines of local text: generated word sequences, then standard-library docstrings."""
    words = syllable_words(20_000, seed)
    rng = random.Random(seed + 1)
    for _ in range(4_000):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for obj in [module, *vars(module).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str):
                yield from doc.splitlines()


def train_tokenizer(vocab_size: int, seed: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Prepend <s> like Llama tokenizers do (add_special_tokens=True).
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def build(out: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab_size: int,
          max_positions: int, seed: int) -> None:  # fmt: skip
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be a multiple of heads, and heads a multiple of kv_heads")
    tok = train_tokenizer(vocab_size, seed)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = max_positions

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    (out / "kvroute_tiny_model.json").write_text(
        json.dumps({"made_by": "scripts/make_tiny_llama.py", "seed": seed, "random_weights": True}) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "models/tiny-llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--hidden", type=int, default=128
    )  # head_dim 32: the smallest vLLM CPU attention takes
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-positions", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("layers", "hidden", "heads", "kv_heads", "vocab_size", "max_positions"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    try:
        build(args.out, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
              vocab_size=args.vocab_size, max_positions=args.max_positions, seed=args.seed)  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    print(f"tiny llama written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
