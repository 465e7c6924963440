"""Install benchmark data into the data directory, verified by sha256, atomically and idempotently.

Each dataset is a list of source files. An install copies (or unpacks, for tarballs) every file into
a temporary folder beside the target, verifies every checksum first, writes a manifest, and only
then renames the folder into place. A crash therefore never leaves a half-installed dataset, and a
second install of a complete dataset is a no-op.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from qevolve.paths import data_dir, shared_data_dir

MANIFEST_NAME = ".qevolve-install.json"


class DataInstallError(RuntimeError):
    """A one-line, user-facing reason why an install failed."""


@dataclass(frozen=True)
class DataFile:
    """One file of a dataset: its path inside the source folder, checksum, and how to install it."""

    relpath: str
    sha256: str
    unpack: bool = False  # a .tar.gz unpacked into the dataset folder (else copied as is)
    url: str | None = None  # upstream download for users without a local copy


# Provenance of every file is in shared/data/README.md; the checksums are the ones listed there.
_ETO = "https://raw.githubusercontent.com/Yifan-Song793/ETO/a2fc5da38f8d00cfaf3f9b6370d586eebaf72904/eval_agent/data/sciworld/"
_WEBSHOP = "https://raw.githubusercontent.com/princeton-nlp/WebShop/64fa2a5c15c7daa698b9ac93f5bb5437b634c9bd/baseline_models/data/"
_AGENTGYM = "https://raw.githubusercontent.com/WooooDyy/AgentGym/3ef9235d23e68e7c2920c5422ad957dc8ced5c6c/agentenv-webshop/webshop/data/"

DATASETS: dict[str, list[DataFile]] = {
    "alfworld": [
        DataFile("alfworld/games_json_2.1.1_tw-pddl.tar.gz",
                 "a3e501cb421175b47d7b67c87bc04314ac99ac8fea6116eca779b8a4053a3395", unpack=True),
        DataFile("alfworld/expert_gt_traj_json_2.1.1.tar.gz",
                 "83a633d6cf9ec1ed2fa050cd7b88a3d702639df4a711358db49f8317846d92f6", unpack=True),
    ],
    "webshop": [
        DataFile("webshop/items_shuffle_1000.json",
                 "e84c57d80d836bf0db1f990668a2b3b220ea1431b1da51d361e8045c5d7451ae"),
        DataFile("webshop/items_ins_v2_1000.json",
                 "f88a36314a397b53b3d9c3fa5878e5f7b26d35019a51ec83fbedeca61a948f6f",
                 url=_AGENTGYM + "items_ins_v2_1000.json"),
        DataFile("webshop/items_human_ins.1k_subset.json",
                 "8bc0ae02b37351395091c55b29352ba21a26a231d093c151cf1a83847ca66359"),
        DataFile("webshop/human_goals.json",
                 "b68746ed66cd31fdc5f70eb3f5831a46b38163563b57a66ddcab8fd60ee0cbdc",
                 url=_WEBSHOP + "human_goals.json"),
        DataFile("webshop/goal_query_map.json",
                 "1524f438ffbc51c7e308e635d7d9e14fa696b08f5d4300922d454ef0105cea86",
                 url=_WEBSHOP + "goal_query_map.json"),
    ],
    "sciworld": [
        DataFile("sciworld/eto_train_indices.json",
                 "c79eea7858383b829269986ee83d0d9a504533e7b4b3a5bc76e5bdc1e6999cd0",
                 url=_ETO + "train_indices.json"),
        DataFile("sciworld/eto_dev_indices.json",
                 "78084ef4393d2da87b21507451821e431daa1a70ab1a486fd1a964ab2404d741",
                 url=_ETO + "dev_indices.json"),
        DataFile("sciworld/eto_test_indices.json",
                 "dfe4ab263824f04a49cf977b8f6d65af516ce13b8cfbef5736a97ed993da7152",
                 url=_ETO + "test_indices.json"),
        DataFile("sciworld/eto_max_steps.json",
                 "035592f47fbe1309b6ed1a260b392a50d94d3163de951508a74e985d93048f73",
                 url=_ETO + "max_steps.json"),
        DataFile("sciworld/eto_taskname2id.json",
                 "5b02636ef23caeb1da567814fa59ab1f62e2a9276b7f28f57ee4d7cfab784fe2",
                 url=_ETO + "taskname2id.json"),
    ],
}


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def dataset_dir(name: str, root: Path | None = None) -> Path:
    return (root or data_dir()) / name


def is_installed(name: str, root: Path | None = None) -> bool:
    manifest = dataset_dir(name, root) / MANIFEST_NAME
    if not manifest.is_file():
        return False
    try:
        recorded = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    expected = {f.relpath: f.sha256 for f in DATASETS[name]}
    return recorded == expected


def require_installed(name: str, root: Path | None = None) -> Path:
    """The dataset folder, or a clear error telling the user how to install it."""
    if not is_installed(name, root):
        raise DataInstallError(
            f"dataset {name!r} is not installed in {dataset_dir(name, root)}: run `qevolve data install {name}`"
        )
    return dataset_dir(name, root)


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
    if name not in DATASETS:
        raise DataInstallError(f"unknown dataset {name!r}; expected one of {sorted(DATASETS)} or 'all'")
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
    path = root / f".{name}.install.lock"
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
    stale = [*root.glob(f".{name}.partial-*"), *root.glob(f".{name}.old-*")]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return len(stale)


def _install_locked(name: str, source: Path | None, root: Path, target: Path, log) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=root))
    try:
        scratch = staging / ".download"
        scratch.mkdir()
        recorded: dict[str, str] = {}
        for file in DATASETS[name]:
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
            old = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=root))
            os.replace(target, old / name)
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
        expanded.extend(sorted(DATASETS) if name == "all" else [name])
    if source is None:
        # A checkout with ../shared/data beside it installs offline from there; elsewhere, download.
        source = shared_data_dir()
    return [install_dataset(name, source, root, force, log) for name in expanded]
