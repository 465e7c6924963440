import shutil

import pytest

from qevolve.data.install import DataInstallError, data_files, install, install_dataset, is_installed
from qevolve.paths import shared_data_dir

SHARED = shared_data_dir()
pytestmark = pytest.mark.skipif(SHARED is None, reason="needs the raw data folder ../shared/data beside the checkout")


def copy_source(tmp_path, name):
    source = tmp_path / "source"
    for file in data_files(name):
        target = source / file.relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SHARED / file.relpath, target)
    return source


def test_install_is_verified_and_idempotent(tmp_path):
    root = tmp_path / "data"
    logs = []
    install(["sciworld", "webshop"], source=SHARED, root=root, log=logs.append)
    assert is_installed("sciworld", root) and is_installed("webshop", root)
    assert (root / "webshop" / "items_shuffle_1000.json").is_file()
    install(["sciworld"], source=SHARED, root=root, log=logs.append)
    assert logs[-1].startswith("sciworld: already installed")


def test_alfworld_install_unpacks_games_and_demonstrations(tmp_path):
    root = tmp_path / "data"
    install_dataset("alfworld", SHARED, root, log=lambda m: None)
    games = root / "alfworld" / "json_2.1.1"
    assert len(list((games / "valid_unseen").glob("*/*/game.tw-pddl"))) == 134
    assert len(list((games / "train").glob("*/*/gt_traj.json"))) == 3554


def test_corrupted_archive_is_rejected_and_leaves_nothing(tmp_path):
    source = copy_source(tmp_path, "alfworld")
    archive = source / "alfworld" / "expert_gt_traj_json_2.1.1.tar.gz"
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    root = tmp_path / "data"
    with pytest.raises(DataInstallError, match=r"expert_gt_traj_json_2\.1\.1\.tar\.gz: sha256 .* does not match"):
        install_dataset("alfworld", source, root, log=lambda m: None)
    # no half-installed folder, no temp leftovers (only the install's lock file stays)
    assert [p.name for p in root.iterdir()] == [".alfworld.install.lock"]


def test_missing_file_and_foreign_folder(tmp_path):
    source = copy_source(tmp_path, "sciworld")
    (source / "sciworld" / "eto_max_steps.json").unlink()
    root = tmp_path / "data"
    with pytest.raises(DataInstallError, match="missing file .*eto_max_steps.json"):
        install_dataset("sciworld", source, root)
    assert [p.name for p in root.iterdir()] == [".sciworld.install.lock"]
    (root / "sciworld").mkdir()
    (root / "sciworld" / "half.json").write_text("{}")
    with pytest.raises(DataInstallError, match="not a complete install .* pass --force"):
        install_dataset("sciworld", SHARED, root)
    install_dataset("sciworld", SHARED, root, force=True, log=lambda m: None)
    assert is_installed("sciworld", root) and not (root / "sciworld" / "half.json").exists()


def test_unknown_dataset(tmp_path):
    with pytest.raises(DataInstallError, match="unknown dataset 'nope'"):
        install(["nope"], source=SHARED, root=tmp_path)
