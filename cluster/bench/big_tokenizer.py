"""A byte-level BPE tokenizer with a production-sized vocabulary (e.g. 128k, Llama 3's), for
benchmarks whose cost grows with the vocabulary (structured output's token masks: llguidance
walks a trie of every token). `manta make-model` checkpoints carry a small tokenizer (a few
thousand tokens: its built-in training corpus stops short); this replaces it.

    python -m cluster.bench.big_tokenizer CHECKPOINT_DIR --vocab 128000
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "str", "th", "tr"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "oo", "ou", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rk", "st", "x"]


def synthetic_vocab(size: int, seed: int = 0) -> list[str]:
    """`size` byte-level token strings (GPT-2's byte-to-character map: 'Ġ' is a space, 'Ċ' a
    newline) shaped like a trained vocabulary's: the 256 bytes, invented words with and without
    a leading space, numbers, punctuation and JSON/code fragments, whitespace runs."""
    from tokenizers import pre_tokenizers

    rng = random.Random(seed)
    out = list(dict.fromkeys(pre_tokenizers.ByteLevel.alphabet()))
    seen = set(out)

    def add(t: str) -> None:
        if t and t not in seen:
            seen.add(t)
            out.append(t)

    for t in ['":', '",', '{"', '"}', '":"', '["', '"]', "},", "ĠĠ", "ĠĠĠĠ", "Ċ", "ĊĠĠ", "ĊĠĠĠĠ", "ĉ", "Ċĉ",
              "()", "):", "Ġ=", "Ġ==", "Ġ+", "Ġ{", "Ġ}", "Ġ[", "Ġ]", "Ġ(", "Ġ\"", ".Ċ", ",Ġ"]:
        add(t)
    for n in range(1000):
        add(str(n))
        add("Ġ" + str(n))
    while len(out) < size:
        n = rng.choice([1, 1, 2, 2, 3])
        w = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(n))
        w = w.capitalize() if rng.random() < 0.15 else w
        add(w)
        add("Ġ" + w)
    return out[:size]


def replace_tokenizer(checkpoint: str | Path, vocab: int) -> int:
    """Save a byte-level BPE tokenizer of `vocab` tokens (the special tokens and chat template
    of `workers.make_tokenizer` first) over the checkpoint's tokenizer; returns its size. Its
    vocabulary is `synthetic_vocab` with no merges: it decodes every id and encodes text byte by
    byte (benchmarks feed token ids), and what a grammar engine sees is a full-size trie."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from workers import make_tokenizer as mt

    specials = list(mt.SPECIAL_TOKENS)
    tokens = specials + synthetic_vocab(vocab - len(specials))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=mt.BOS, eos_token=mt.EOS, pad_token=mt.PAD,
                                   unk_token=mt.UNK, additional_special_tokens=[mt.IM_START, mt.IM_END],
                                   clean_up_tokenization_spaces=False, chat_template=mt.CHAT_TEMPLATE)
    fast.save_pretrained(str(checkpoint))
    return len(fast)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--vocab", type=int, default=128000)
    args = p.parse_args()
    t0 = time.perf_counter()
    n = replace_tokenizer(args.checkpoint, args.vocab)
    print(f"tokenizer of {n} tokens written to {args.checkpoint} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
