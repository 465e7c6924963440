"""The data an environment declares (:attr:`Environment.data_files`) and where it finds it once installed.

``qevolve data install NAME`` (:mod:`qevolve.data.install`) copies or unpacks an environment's files into
the data directory's folder NAME and writes a manifest of their checksums there last; an environment
asks :func:`require_installed` for that folder, which is complete only when the manifest lists exactly
the files the environment declares now.
"""

from __future__ import annotations

import json
from pathlib import Path

from qevolve.environments.base import DataFile, environment_names, get_factory
from qevolve.paths import data_dir, path_safe

__all__ = ["MANIFEST_NAME", "DataInstallError", "data_files", "dataset_dir", "dataset_names", "is_installed",
           "require_installed"]

#: the manifest an install writes into the dataset folder: ``{"dataset": NAME, "files": {relpath: sha256}}``
MANIFEST_NAME = ".qevolve-install.json"


class DataInstallError(RuntimeError):
    """A one-line, user-facing reason why an install failed or a dataset is missing."""


def data_files(name: str) -> tuple[DataFile, ...]:
    """The files environment ``name`` declares (its class's ``data_files``); an unknown environment, or one
    that declares no files, is an error naming the datasets there are."""
    try:
        factory = get_factory(name)
    except KeyError as err:
        if ":" in name:  # a module:name spec: why it does not load says more than the list of datasets
            raise DataInstallError(err.args[0] if err.args else str(err)) from None
        raise DataInstallError(f"unknown dataset {name!r}; expected one of {dataset_names()} or 'all'") from None
    files = tuple(getattr(factory, "data_files", ()) or ())
    if not files:
        raise DataInstallError(f"environment {name!r} declares no data files, so there is nothing to install; "
                               f"datasets: {dataset_names()}")
    wrong = next((file for file in files if not isinstance(file, DataFile)), None)
    if wrong is not None:
        raise DataInstallError(f"environment {name!r}: data_files holds {wrong!r}; expected "
                               "qevolve.environments.base.DataFile entries")
    return files


def dataset_names() -> list[str]:
    """The environments that declare data files, by name (the built-in, registered and installed ones)."""
    return [name for name in environment_names() if getattr(get_factory(name), "data_files", ())]


def dataset_dir(name: str, root: Path | None = None) -> Path:
    return (root or data_dir()) / path_safe(name)


def is_installed(name: str, root: Path | None = None) -> bool:
    manifest = dataset_dir(name, root) / MANIFEST_NAME
    if not manifest.is_file():
        return False
    try:
        recorded = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    expected = {f.relpath: f.sha256 for f in data_files(name)}
    return recorded == expected


def require_installed(name: str, root: Path | None = None) -> Path:
    """The dataset folder, or a clear error telling the user how to install it."""
    if not is_installed(name, root):
        raise DataInstallError(
            f"dataset {name!r} is not installed in {dataset_dir(name, root)}: run `qevolve data install {name}`"
        )
    return dataset_dir(name, root)
