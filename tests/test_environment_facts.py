"""An environment is its own folder plus one registry entry: what it declares there (prompt, turn format,
retrospective penalties, action kinds, worker recycling, data files, expert source, task types and
retries) is what every part of qevolve uses, with nothing about it written anywhere else."""

from __future__ import annotations

import ast
import hashlib
import json
import re
from pathlib import Path
from typing import Iterator

import pytest

import qevolve
from qevolve.environments.base import _BUILTIN_MODULES, DataFile, get_factory

PACKAGE = Path(qevolve.__file__).parent

DOC = Path(__file__).resolve().parents[1] / "docs" / "own-environment.md"


def doc_package() -> dict[str, str]:
    """The doc's worked example, the package ``lamps``: its python blocks whose first line names a file."""
    blocks = re.findall(r"^```python\n# (lamps/\S+)\n(.*?)^```", DOC.read_text(), re.S | re.M)
    return dict(blocks)


BULBS = '{"bulbs": 5}\n'


@pytest.fixture
def lamps(tmp_path, monkeypatch) -> Iterator[Path]:
    """The doc's package ``lamps`` in ``site/lamps`` (with its data under ``data/``), named ``lamps`` through
    the entry-point group ``qevolve.environments`` of its distribution, as an installed package is."""
    site = tmp_path / "site"
    folder = site / "lamps"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "bulbs.json").write_text(BULBS)
    files = doc_package()
    assert set(files) == {"lamps/env.py", "lamps/__init__.py"}
    digest = hashlib.sha256(BULBS.encode()).hexdigest()
    for name, body in files.items():
        (site / name).write_text(body.replace("<sha256 of the file>", digest))
    dist = site / "lamps-0.1.dist-info"  # the one registry entry
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lamps\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[qevolve.environments]\nlamps = lamps\n")
    monkeypatch.syspath_prepend(str(site))
    yield folder
    # Leave the process as it found it: later tests list the environments by name (docs/errors.md does).
    import sys

    from qevolve.critic import retrospective
    from qevolve.environments import base

    for key in [key for key in base._REGISTRY if key == "lamps" or key.startswith("lamps.")]:
        del base._REGISTRY[key]
    retrospective._DECLARED.pop("lamps", None)
    for module in [module for module in sys.modules if module == "lamps" or module.startswith("lamps.")]:
        del sys.modules[module]


def test_every_fact_of_a_new_environment_comes_from_its_own_folder(lamps, tmp_path, monkeypatch):
    from qevolve.buffer.store import Episode, Turn
    from qevolve.critic.retrospective import AuxPenalties, RetrospectiveConfig, aux_rewards, penalties_for
    from qevolve.data.install import dataset_names, install
    from qevolve.environments.base import environment_names
    from qevolve.environments.experts import expert_retries, expert_task_type, filter_task_types
    from qevolve.environments.pool import EnvPool
    from qevolve.evaluation.diagnostics import action_kind
    from qevolve.prompting import PromptConfig, environment_instruction, resolve_turn_format

    assert "lamps" in environment_names()
    env_class = get_factory("lamps")
    assert Path(env_class.__module__.replace(".", "/") + ".py") == Path("lamps/env.py")
    # the prompt and the turn format of its demonstrations
    assert environment_instruction("lamps") == env_class.instruction
    assert resolve_turn_format(PromptConfig(), "lamps").turn_format == "thought_action"
    # the critic's r_aux: the class's penalties, no config entry needed
    penalties = AuxPenalties(format_error=-0.5, invalid_action=-0.25, repeat=0.0)
    assert penalties_for("lamps", RetrospectiveConfig()) == penalties
    episode = Episode("e", "count-2", "lamps", "train", "self", final_observation="count 1", turns=[
        Turn(observation="start", agent_text="x", action=None, format_valid=False, action_valid=False),
        Turn(observation="start", agent_text="x", action="wait", format_valid=True, action_valid=False),
        Turn(observation="Nothing happens.", agent_text="x", action="next", format_valid=True, action_valid=True)])
    assert aux_rewards(episode, RetrospectiveConfig()) == [-0.5, -0.25, 0.0]
    # the label diagnostics' action kinds
    assert [action_kind("lamps", action) for action in ("next", "wait 1")] == ["switch", "other"]
    # the expert's task types and retries
    assert expert_task_type("lamps")("count-2") == "short" and expert_retries("lamps")("count-5") == 1
    assert filter_task_types("lamps", env_class().tasks("train"), ["short"]) == ["count-1", "count-2"]
    # its data: installed from its own folder, found by the environment
    assert "lamps" in dataset_names()
    monkeypatch.setenv("QEVOLVE_DATA_DIR", str(tmp_path / "data"))
    (installed,) = install(["lamps"], source=lamps, log=lambda line: None)
    assert installed == tmp_path / "data" / "lamps" and env_class().bulbs() == BULBS
    # worker recycling, which the pool reads from the class
    with EnvPool("lamps", num_workers=1) as pool:
        assert pool.max_episodes_per_worker == 7


def test_an_environment_without_declarations_gets_the_defaults():
    from qevolve.critic.retrospective import RetrospectiveConfig, penalties_for
    from qevolve.data.install import DataInstallError, install
    from qevolve.environments.base import Environment
    from qevolve.evaluation.diagnostics import action_kind
    from qevolve.prompting import PromptConfig, resolve_turn_format

    spec = "qevolve.environments.testing:QuietCounterEnv"
    env_class = get_factory(spec)
    assert (env_class.turn_format, env_class.recycle_workers_after, env_class.data_files) == ("action", None, ())
    assert env_class.retrospective_penalties is None and env_class.action_kind is Environment.action_kind
    assert resolve_turn_format(PromptConfig(), spec).turn_format == "action"
    assert action_kind(spec, "go to desk 1") == "go to"
    with pytest.raises(ValueError, match="its class declares no retrospective_penalties"):
        penalties_for(spec, RetrospectiveConfig())
    with pytest.raises(DataInstallError, match="declares no data files, so there is nothing to install"):
        install([spec])


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("name", sorted(_BUILTIN_MODULES))
def test_a_built_in_environment_is_its_folder_and_its_registry_line(name):
    """Nothing outside the environment's folder imports it: the registry names it by its module."""
    module = _BUILTIN_MODULES[name]
    folder = PACKAGE / "environments" / name
    assert module == f"qevolve.environments.{name}" and (folder / "__init__.py").is_file()
    outside = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if folder not in path.parents
               and any(target == module or target.startswith(module + ".") for target in _imports(path))]
    assert outside == []
    env_class = get_factory(name)
    assert Path(env_class.__module__.replace(".", "/")).parent == Path(module.replace(".", "/"))
    assert env_class.retrospective_penalties is not None and env_class.instruction
    assert env_class.data_files and all(isinstance(f, DataFile) and f.relpath.startswith(f"{name}/")
                                        for f in env_class.data_files)
    from qevolve.environments.experts import get_expert_source

    get_expert_source(name)  # registered by the folder's own __init__


def test_the_data_manifest_lists_what_the_environment_declares(tmp_path):
    """An install records the declared checksums; a declaration that changes leaves the folder not installed."""
    from qevolve.environments.installed_data import MANIFEST_NAME, is_installed

    files = get_factory("webshop").data_files
    folder = tmp_path / "webshop"
    folder.mkdir()
    (folder / MANIFEST_NAME).write_text(json.dumps({"dataset": "webshop",
                                                    "files": {f.relpath: f.sha256 for f in files}}))
    assert is_installed("webshop", tmp_path)
    (folder / MANIFEST_NAME).write_text(json.dumps({"dataset": "webshop",
                                                    "files": {f.relpath: f.sha256 for f in files[1:]}}))
    assert not is_installed("webshop", tmp_path)
