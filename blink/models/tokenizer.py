"""Tokenizer + chat template, built from GGUF metadata or an HF directory. No network.

GGUF: a byte-level BPE `tokenizers.Tokenizer` from tokenizer.ggml.{tokens,merges,token_type};
control tokens (type 3) become special added tokens. SentencePiece vocabularies (tokenizer.ggml.model
"llama": Llama 2, Mistral) carry scores instead of merges: the merges are recovered from the
scores (each piece that splits into two pieces of the vocabulary is that pair's merge, ranked by
the piece's score), with byte fallback and the "▁" word-boundary marker (checked against the
sentencepiece library on a model trained in the tests). The pre-tokenizer splits digits one by one
before the GPT-2 regex, which is llama.cpp's "smollm" pre-type (verified against transformers on
digits, unicode, whitespace, code and chat prompts). Chat templates render in a sandboxed jinja2
environment configured as transformers does (trim_blocks, lstrip_blocks, raise_exception).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from blink.models.config import UnsupportedModelError

_CONTROL = 3  # llama.cpp token_type for control tokens
_USER_DEFINED = 4  # added tokens matched whole, not special


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _compile_template(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(source)


class Tokenizer:
    """encode/decode + chat template; ids of bos/eos and the special tokens."""

    def __init__(
        self,
        tok: Any,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool = False,
    ) -> None:
        self._tok = tok
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos
        self.special_tokens = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def set_chat_template(self, source: str) -> None:
        """Replace the model's chat template (compiled now: a syntax error is raised here)."""
        try:
            template = _compile_template(source)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise ValueError(f"chat template does not compile: {e}") from e
        self.chat_template, self._template = source, template

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def token_str(self, i: int | None) -> str:
        return "" if i is None else (self._tok.id_to_token(int(i)) or "")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.with_bos(self._tok.encode(text, add_special_tokens=False).ids, add_bos)

    def with_bos(self, ids: list[int], add_bos: bool | None = None) -> list[int]:
        """Encoded ids with the BOS this model adds (add_bos None), or as add_bos says."""
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def backend_json(self) -> str:
        """The `tokenizers.Tokenizer` as JSON (Tokenizer.from_str rebuilds it in another process)."""
        return self._tok.to_str()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The messages through the chat template; variables: extra template variables (a
        request's chat_template_kwargs), which never replace the messages or the special tokens."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        # One mapping, not keywords: a variable named like render()'s own parameters ("self") is
        # just a variable; the ones set here win over the caller's.
        context = {
            **(variables or {}),
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.token_str(self.bos_token_id),
            "eos_token": self.token_str(self.eos_token_id),
        }
        from jinja2 import TemplateError

        try:
            return self._template.render(context)
        except (TemplateError, TypeError, AttributeError, KeyError, IndexError, ArithmeticError) as e:
            # a template that fails on these messages or variables (the sandbox's refusals too)
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template already contains any bos text; do not add another.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)


# llama.cpp pre-tokenizer types -> the split regex HF's tokenizer.json uses for those models.
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# "dbrx": llama.cpp's name for the cl100k_base split, which Phi-4's tokenizer uses too (the Llama-3 regex).
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return byte_level
    if pre == "smollm":  # llama.cpp: each digit alone, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise UnsupportedModelError(
        f"GGUF pre-tokenizer {pre!r} is not supported ({', '.join(['gpt2', 'smollm', *_SPLITS])})"
    )


def from_gguf_metadata(meta: Mapping[str, Any]) -> Tokenizer:
    """Build from decoded GGUF metadata (`blink.models.gguf_weights.gguf_metadata`)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_from_gguf(meta)
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (gpt2 byte-level BPE, llama SentencePiece BPE)"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    return _gguf_tokenizer(tok, meta, tokens, types, add_bos_default=False)


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece BPE vocabulary: (left, right) for every piece that
    splits into two pieces of the vocabulary, highest piece score first (a piece's score is the
    rank of the merge that made it); ties: longer left piece first, then by the pieces' ids."""
    ids = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in ids and right in ids:
                found.append((-float(score), -len(left), -len(right), ids[left], ids[right], left, right))
    found.sort()
    return [(f[5], f[6]) for f in found]


def _sentencepiece_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """A SentencePiece BPE vocabulary (llama.cpp's "llama" tokenizer model) as a tokenizers BPE."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = list(meta.get("tokenizer.ggml.scores", [0.0] * len(tokens)))
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    if unk is None:
        unk = next((i for i, ty in enumerate(types) if ty == 2), None)  # 2: UNKNOWN
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=spm_merges(tokens, scores),
        unk_token=None if unk is None else tokens[int(unk)],
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # SentencePiece: spaces become "▁", and (add_dummy_prefix) every run of text gets one in front,
    # even one that starts with a space; llama.cpp does this for the text after each special token.
    rules = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*rules, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _USER_DEFINED
    ]
    if user:
        tok.add_tokens(user)
    return _gguf_tokenizer(tok, meta, tokens, types, add_bos_default=True)  # SentencePiece models add BOS


def _gguf_tokenizer(
    tok: Any, meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int], add_bos_default: bool
) -> Tokenizer:
    """A Tokenizer over `tok`: the GGUF's control tokens as special added tokens, its chat
    template, BOS, and EOS (+ EOT) ids."""
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    ends = (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"))
    return Tokenizer(
        tok,
        meta.get("tokenizer.chat_template"),
        None if bos is None else int(bos),
        list(dict.fromkeys(int(x) for x in ends if x is not None)),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
    )


def _token_content(v: Any) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def from_hf_dir(path: str | os.PathLike[str], eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """Load tokenizer.json + tokenizer_config.json (+ chat_template.jinja) from an HF directory.
    `eos_token_ids` (e.g. from config.json / generation_config.json) extend the template's eos."""
    from tokenizers import Tokenizer as HFTokenizer

    root = pathlib.Path(path)
    tok = HFTokenizer.from_file(os.fspath(root / "tokenizer.json"))
    cfg_path = root / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if template is None and (root / "chat_template.jinja").exists():
        template = (root / "chat_template.jinja").read_text()
    bos_str, eos_str = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
    bos = tok.token_to_id(bos_str) if bos_str else None
    eos = [tok.token_to_id(eos_str)] if eos_str and tok.token_to_id(eos_str) is not None else []
    gen_path = root / "generation_config.json"
    if gen_path.exists():
        g = json.loads(gen_path.read_text()).get("eos_token_id")
        eos += g if isinstance(g, list) else ([g] if g is not None else [])
    eos += list(eos_token_ids)
    # Without an explicit add_bos_token, follow tokenizer.json's post-processor (Llama 3 adds BOS there).
    post_bos = bos is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos]
    return Tokenizer(
        tok, template, bos, list(dict.fromkeys(int(e) for e in eos)), add_bos=bool(cfg.get("add_bos_token", post_bos))
    )
