"""The tokenizer of manta's random checkpoints, built offline with `tokenizers`.

A byte-level BPE trained on a small built-in English corpus, with `<unk>`=0, `<s>`=1 (prepended
on encode), `</s>`=2, `<pad>`=3, `<|im_start|>`=4, `<|im_end|>`=5 and a ChatML chat template,
saved as a `transformers` fast tokenizer (`workers.make_model` writes it beside the weights).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

UNK, BOS, EOS, PAD, IM_START, IM_END = "<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, IM_START, IM_END)  # ids 0..5, in this order
UNK_ID, BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

# Llama-3 style: the template emits bos itself, so render with `tokenize=True` (or encode the
# rendered text with add_special_tokens=False) to get exactly one bos.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Word lists of the templated part of the corpus, separated by "|".
_SUBJECTS = (
    "the cat|a small dog|my neighbour|the old teacher|our team|the engineer|a student|the river|"
    "this machine|the city council|every child|the weather|a quiet musician|the farmer|her brother|"
    "the server|the model|a tired traveller|the library|we|they|you|I|the company|the scientist|"
    "an artist|the captain|the baker"
).split("|")
_VERBS = (
    "walks to|looks at|writes about|builds|remembers|finds|carries|paints|reads|answers|opens|"
    "closes|follows|measures|repairs|explains|visits|watches|cooks|sells|buys|counts|draws|"
    "forgets|sends|learns about|talks about"
).split("|")
_OBJECTS = (
    "the garden|a red apple|the long letter|three books|the bridge|a new house|the mountain road|"
    "the morning news|an old map|the blue door|the market|a question|the kitchen table|"
    "the train station|the final report|a bright star|the broken window|the ocean|a cup of tea|"
    "the evening sky|the answer|a simple program|the summer holiday"
).split("|")
_TAILS = (
    "before breakfast|after the rain|with great care|every Sunday|in the afternoon|without a word|"
    "because it was late|at the end of the day|for the first time|again|near the park|"
    "on Monday morning|while singing|as quickly as possible|last year|in 2024|at 7:30 pm|"
    "twice a week|with two friends|during the storm"
).split("|")
_QUESTIONS = (
    "What is the capital of France?|How many days are there in a week?|Why is the sky blue?|"
    "Can you explain how a computer works?|Where did you put the keys?|Who wrote this story?|"
    "When does the next train leave?|Which way is the museum?|Is it going to rain tomorrow?|"
    "Could you tell me a short joke?|What time is it in Tokyo?|How do plants grow?"
).split("|")
_FIXED_LINES = [
    "Hello, world! This is a test.",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, there was a little girl who lived in a village near the forest.",
    "It's a beautiful day, isn't it? Let's go outside and play.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 3.14 1,000,000 and 2e-5.",
    "Prices went up by 15% (from $20 to $23) in three months.",
    "Email me at someone@example.com or visit https://example.com/docs?page=2.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    '{"name": "manta", "version": 1, "ok": true}',
    "Café, naïve, résumé, façade, jalapeño, Zürich, São Paulo.",
    "Quotes “like these” and ‘these’ — with dashes – and ellipses…",
    "Tabs\tand  double  spaces, new lines\nand more lines.",
    "User: Hi there!\nAssistant: Hello! How can I help you today?",
    "Please summarise the following paragraph in one sentence.",
    "Translate to French: The house is small but very warm.",
    "Write a poem about the sea, the wind and the stars.",
    "Machine learning models predict the next token from the previous tokens.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Water boils at 100 degrees Celsius at sea level.",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "!?.,;:'\"()[]{}<>/\\|@#$%^&*-_=+~`",
]


def builtin_corpus(lines: int = 600, seed: int = 1234) -> list[str]:
    """A deterministic English-ish corpus: fixed lines plus templated sentences and questions."""
    rng = random.Random(seed)
    out = list(_FIXED_LINES)
    for i in range(lines):
        kind = i % 4
        if kind == 3:
            out.append(rng.choice(_QUESTIONS))
            continue
        subj, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
        s = f"{subj[0].upper()}{subj[1:]} {verb} {obj} {rng.choice(_TAILS)}"
        if kind == 1:
            s += f", and then {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        out.append(s + rng.choice([".", ".", ".", "!", "?", "..."]))
    return out


def build_tokenizer(out_dir: str | Path, vocab_size: int) -> Any:
    """Train a byte-level BPE on `builtin_corpus()` and save it as a PreTrainedTokenizerFast.

    The trained vocab has at most `vocab_size` entries (special tokens included; a small corpus may
    stop short of it), so a model whose vocab_size >= `vocab_size` covers every token id.
    Returns the loaded transformers tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size {vocab_size} is below 256 bytes + {len(SPECIAL_TOKENS)} special tokens")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_corpus(), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, BOS_ID)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
        chat_template=CHAT_TEMPLATE,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    _make_tokenizer_files_portable(out)
    return fast


def _make_tokenizer_files_portable(out: Path) -> None:
    """Add what transformers 5 no longer writes but 4.x readers (and other engines) look for.

    transformers 5 saves `tokenizer_class: TokenizersBackend`, the chat template in a separate
    `chat_template.jinja`, `extra_special_tokens`, and no `add_bos_token` / special_tokens_map.json.
    We keep all of that and also write the 4.x spellings; transformers 5 loads either.
    """
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=True,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=[IM_START, IM_END],
    )
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
