"""SentencePiece vocabularies in GGUF (tokenizer.ggml.model "llama": Llama 2, Mistral): a BPE model
trained here with the sentencepiece library, written into GGUF metadata the way llama.cpp's
converter writes it (pieces, scores, token types), must tokenize and detokenize exactly as
sentencepiece does: byte fallback, the "▁" dummy prefix, runs of spaces, digits, newlines."""

from __future__ import annotations

import io
import random

import pytest

from blink.models.config import preset
from blink.models.registry import resolve_model
from blink.models.tokenizer import from_gguf_metadata, spm_merges

spm = pytest.importorskip("sentencepiece")

WORDS = (
    "the quick brown fox jumps over lazy dog hello world tokenizer model byte fallback piece merge "
    "score café naïve über 東京 データ"
).split()


@pytest.fixture(scope="module")
def trained():
    rng = random.Random(0)
    lines = []
    for _ in range(600):
        ws = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            ws.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(ws) + rng.choice([".", ",", "!", "?", ""]))
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(  # Llama 2's settings: BPE, byte fallback, identity normalization
        sentence_iterator=iter(lines),
        model_writer=buf,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        character_coverage=0.99,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):  # as llama.cpp's convert_hf_to_gguf.py writes them
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        kind = 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i) else 1
        types.append(kind)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }
    return sp, meta, lines


CASES = [
    "hello world",
    "The quick brown fox.",
    "  two  spaces",
    " lead",
    "trail ",
    "café über 東京",
    "Ω and an emoji 🙂 are bytes",
    "12345 67",
    "line\nbreak\n\nagain",
    "naïve データ model!",
]


def test_encode_decode_equal_sentencepiece(trained):
    sp, meta, lines = trained
    tok = from_gguf_metadata(meta)
    assert any(t == 6 for t in meta["tokenizer.ggml.token_type"])  # byte pieces exist
    used_bytes = False
    for s in CASES + lines[:300]:
        ids = tok.encode(s, add_bos=False)
        assert ids == sp.encode(s), s
        assert tok.decode(ids) == sp.decode(ids) == s, s
        used_bytes |= any(meta["tokenizer.ggml.token_type"][i] == 6 for i in ids)
    assert used_bytes  # the byte fallback was exercised
    assert tok.encode("hi")[0] == sp.bos_id()  # SentencePiece models add BOS by default
    assert tok.special_tokens == {"<s>": sp.bos_id(), "</s>": sp.eos_id()}


def test_merges_follow_piece_scores():
    tokens = ["a", "b", "c", "ab", "abc", "bc"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0]
    assert spm_merges(tokens, scores) == [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]


def test_gguf_file_with_a_sentencepiece_vocabulary(trained, tmp_path):
    """The whole path: a Llama-architecture GGUF whose tokenizer is SentencePiece, served by name."""
    pytest.importorskip("gguf")
    from test_models_gguf_roundtrip import write_gguf  # noqa: PLC0415 (the converter-shaped writer)

    from blink.models.weights import random_weights

    sp, meta, _ = trained
    c = preset("tiny-llama").replace(vocab_size=len(meta["tokenizer.ggml.tokens"]), bos_token_id=1, eos_token_ids=(2,))
    path = tmp_path / "spm.gguf"
    write_gguf(path, c, random_weights(c, seed=1), tokenizer=meta)
    bundle = resolve_model(path)
    assert bundle.tokenizer.encode("hello world", add_bos=False) == sp.encode("hello world")
