"""Install benchmark data into the data directory, verified by sha256, atomically and idempotently.

Each dataset is the list of source files an environment declares (its class's ``data_files``, see
:mod:`qevolve.environments.installed_data`), named like the environment. An install copies (or
unpacks, for tarballs) every file into a temporary folder beside the target, verifies every checksum
first, writes a manifest, and only then renames the folder into place. A crash therefore never
leaves a half-installed dataset, and a second install of a complete dataset is a no-op.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Iterator

from qevolve.environments.installed_data import (MANIFEST_NAME, DataFile, DataInstallError, data_files, dataset_dir,
                                                 dataset_names, is_installed)
from qevolve.paths import data_dir, path_safe, shared_data_dir

__all__ = ["DataFile", "DataInstallError", "MANIFEST_NAME", "clean_stale_staging", "data_files", "dataset_dir",
           "dataset_names", "install", "install_dataset", "is_installed", "sha256_of"]


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _fetch(file: DataFile, source: Path | None, scratch: Path) -> Path:
    """Return a local path holding the source file (the original, or a download in ``scratch``)."""
    if source is not None:
        local = source / file.relpath
        if not local.is_file():
            # Accept a flat folder too (all files of one dataset side by side).
            flat = source / Path(file.relpath).name
            if flat.is_file():
                return flat
            raise DataInstallError(f"missing file {local} (expected by dataset file {file.relpath})")
        return local
    if file.url is None:
        raise DataInstallError(
            f"{file.relpath} has no single upstream download with this checksum; build it from the source "
            "named in the data README and pass --from DIR"
        )
    target = scratch / Path(file.relpath).name
    try:
        with urllib.request.urlopen(file.url, timeout=60) as response, open(target, "wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as err:
        raise DataInstallError(f"download of {file.url} failed: {err}") from None
    return target


def _safe_extract(archive: Path, dest: Path) -> None:
    try:
        with tarfile.open(archive, "r:*") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, EOFError, OSError) as err:
        raise DataInstallError(f"{archive}: cannot unpack ({err})") from None


def install_dataset(name: str, source: Path | None = None, root: Path | None = None, force: bool = False,
                    log=print) -> Path:
    """Install dataset ``name`` from folder ``source`` (or upstream) into ``root`` (the data dir).

    Idempotent: a complete, verified install is left alone unless ``force``. A folder at the target
    without a valid manifest (a foreign or damaged install) is an error unless ``force``.
    """
    data_files(name)  # an unknown dataset is an error before anything is written
    root = root or data_dir()
    target = dataset_dir(name, root)
    if is_installed(name, root) and not force:
        log(f"{name}: already installed in {target}")
        return target
    if target.exists() and not force:
        raise DataInstallError(
            f"{target} exists but is not a complete install of {name!r} (no valid {MANIFEST_NAME}); "
            "remove it or pass --force"
        )
    root.mkdir(parents=True, exist_ok=True)
    with _install_lock(root, name):
        removed = clean_stale_staging(root, name)
        if removed:
            log(f"{name}: removed {removed} staging folder(s) left by an interrupted install")
        return _install_locked(name, source, root, target, log)


@contextlib.contextmanager
def _install_lock(root: Path, name: str) -> Iterator[None]:
    """An exclusive lock on ``root/.NAME.install.lock``: one install of a dataset at a time, and a
    staging folder found while holding it belongs to an install that died (the kernel drops the
    lock of a killed process)."""
    path = root / f".{path_safe(name)}.install.lock"
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataInstallError(f"{path}: another process is installing {name!r}; wait for it to finish") \
                from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def clean_stale_staging(root: Path, name: str) -> int:
    """Remove ``.NAME.partial-*`` and ``.NAME.old-*`` folders (call only under the install lock)."""
    stale = [*root.glob(f".{path_safe(name)}.partial-*"), *root.glob(f".{path_safe(name)}.old-*")]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return len(stale)


def _install_locked(name: str, source: Path | None, root: Path, target: Path, log) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=f".{path_safe(name)}.partial-", dir=root))
    try:
        scratch = staging / ".download"
        scratch.mkdir()
        recorded: dict[str, str] = {}
        for file in data_files(name):
            local = _fetch(file, source, scratch)
            digest = sha256_of(local)
            if digest != file.sha256:
                raise DataInstallError(
                    f"{local}: sha256 {digest[:16]}... does not match the expected {file.sha256[:16]}..."
                )
            if file.unpack:
                log(f"{name}: unpacking {local.name}")
                _safe_extract(local, staging)
            else:
                shutil.copyfile(local, staging / Path(file.relpath).name)
            recorded[file.relpath] = file.sha256
        shutil.rmtree(scratch)
        (staging / MANIFEST_NAME).write_text(json.dumps({"dataset": name, "files": recorded}, indent=1))
        if target.exists():
            # --force: move the old folder aside first so the swap is two renames, never a half copy.
            old = Path(tempfile.mkdtemp(prefix=f".{path_safe(name)}.old-", dir=root))
            os.replace(target, old / target.name)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"{name}: installed into {target}")
    return target


def install(names: list[str], source: Path | None = None, root: Path | None = None, force: bool = False,
            log=print) -> list[Path]:
    """Install several datasets; ``all`` expands to every known one."""
    expanded: list[str] = []
    for name in names:
        expanded.extend(dataset_names() if name == "all" else [name])
    if source is None:
        # A checkout with ../shared/data beside it installs offline from there; elsewhere, download.
        source = shared_data_dir()
    return [install_dataset(name, source, root, force, log) for name in expanded]
