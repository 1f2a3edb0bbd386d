"""Models in the Hugging Face cache: a Hub repo id (``vllm serve Qwen/Qwen3-8B``) names the
snapshot that ``huggingface-cli download`` (or an earlier vLLM run) left on this machine. Weir
downloads nothing; a repo id that the cache lacks stays a name that is no file.
"""

import os
import re
from pathlib import Path
from typing import Any

# A Hugging Face Hub repo id ("org/name", or a name alone), as `vllm serve` takes a model.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps what it downloads, as it reads its variables:
    $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (under $XDG_CACHE_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def cached_snapshot(
    name: str | os.PathLike[str], cache: Path | None = None, revision: str = "main"
) -> Path | None:
    """The snapshot of repo id ``name`` at ``revision`` (a branch or tag its refs name, or a
    commit) in the Hugging Face cache (``cache``, else ``hub_cache_dir()``: what
    ``huggingface-cli download`` or an earlier vLLM run left there), for a ``name`` that is
    no file or directory; None where the cache has none. Weir downloads nothing."""
    name = str(name)
    if not REPO_ID.fullmatch(name) or Path(name).exists() or ".." in revision.split("/"):
        return None
    repo = (cache or hub_cache_dir()) / ("models--" + name.replace("/", "--"))
    ref = repo / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if commit and snapshot.is_dir() else None


def local_path(name: str) -> str:
    """``name``, or the cached snapshot of the Hub repo it names (``cached_snapshot``)."""
    snapshot = cached_snapshot(name)
    return name if snapshot is None else str(snapshot)


def model_name_of(model_dir: Path) -> str:
    """What the API calls a model by default: its directory's name, or the repo id of a
    Hugging Face cache snapshot (``.../models--ORG--NAME/snapshots/COMMIT``), as vLLM."""
    repo = model_dir.parent.parent.name
    if model_dir.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return model_dir.name


def resolve_hub_ids(
    options: dict[str, Any],
    download_dir: str | None = None,
    revision: str | None = None,
    tokenizer_revision: str | None = None,
) -> dict[str, Any]:
    """``options`` (engine options) with the ``model``, ``tokenizer`` and
    ``speculative_model`` that name a repo id in the Hugging Face cache as their snapshots:
    vLLM's ``download_dir`` (the cache to read, its cache_dir), ``revision`` and
    ``tokenizer_revision`` (the snapshot read there). ValueError: a ``download_dir``
    without a model, or another revision than main of anything the cache does not hold at
    that revision (Weir fetches none)."""
    model = options.get("model")
    if download_dir is not None and model is None:
        raise ValueError(
            "--download-dir is refused without a model: Weir keeps its bundled default model "
            "in $WEIR_CACHE (set it to choose where)"
        )
    cache = None if download_dir is None else Path(download_dir).expanduser()
    resolved = dict(options)
    tokenizer_revision = tokenizer_revision or "main"
    if resolved.get("tokenizer") is None and tokenizer_revision != "main":
        resolved["tokenizer"] = model  # vLLM's: the model's tokenizer, at that revision
    for name, flag, at in (
        ("model", "--revision", revision or "main"),
        ("tokenizer", "--tokenizer-revision", tokenizer_revision),
        ("speculative_model", None, "main"),
    ):
        value = resolved.get(name)
        snapshot = None if value is None else cached_snapshot(value, cache, at)
        if snapshot is not None:
            resolved[name] = str(snapshot)
        elif at != "main":
            files = "model's" if name == "model" else "tokenizer's"
            raise ValueError(
                f"{flag} {at!r} is refused: Weir reads the {files} files as they are on disk "
                f"and fetches no revision, and {value or 'the bundled model'!r} is no Hub repo "
                f"whose {at} the Hugging Face cache {cache or hub_cache_dir()} holds: download "
                f"it (huggingface-cli download {value} --revision {at}) or check it out into a "
                "directory"
            )
    return resolved
