"""Models by Hugging Face name: `blink serve HuggingFaceTB/SmolLM2-135M-Instruct`, as `vllm serve`.

A name is resolved once, at the edge (the CLI), to a local snapshot directory (config.json,
*.safetensors, tokenizer files) that every process then loads as an HF directory
(blink.models.registry). The local Hugging Face cache comes first; `offline` (the caller reads
HF_HUB_OFFLINE) forbids downloads; online, what the cache lacks is downloaded with huggingface_hub.
Every failure is a HubError whose message is one line.
"""

from __future__ import annotations

import os
import pathlib
import re

# what an HF-format model of ours needs; no *.bin / *.pth / *.gguf copies of the same weights
PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class HubError(RuntimeError):
    """A model name that cannot be resolved to a local directory; the message says why."""


def is_repo_id(spec: str) -> bool:
    """`org/name` that is not a local path (nor a GGUF file, nor random:<preset>)."""
    return bool(_REPO_ID.fullmatch(spec)) and not os.path.exists(spec) and not spec.endswith(".gguf")


def _complete(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file() and any(path.glob("*.safetensors"))


def resolve(repo_id: str, offline: bool, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """The local snapshot of `repo_id` (downloaded unless cached or offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    kw = {"allow_patterns": list(PATTERNS), "cache_dir": os.fspath(cache_dir) if cache_dir else None}
    try:
        path = pathlib.Path(snapshot_download(repo_id, local_files_only=True, **kw))
        if _complete(path):
            return path
    except LocalEntryNotFoundError:
        pass
    if offline:
        raise HubError(
            f"model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            "fetch it once online (`blink pull NAME`) or unset HF_HUB_OFFLINE"
        )
    try:
        path = pathlib.Path(snapshot_download(repo_id, local_files_only=False, **kw))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"model {repo_id!r} could not be downloaded from the Hugging Face Hub: {first}") from e
    if not _complete(path):
        raise HubError(
            f"model {repo_id!r} is not an HF-format model Blink can load "
            "(config.json, tokenizer.json and *.safetensors); for a GGUF file, pass its path"
        )
    return path
