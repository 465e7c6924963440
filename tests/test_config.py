from typing import Literal

import pytest
from pydantic import Field

from qevolve.config import ConfigError, StageConfig, apply_overrides, describe_config, load_config


class Inner(StageConfig):
    lr: float = Field(1e-4, description="learning rate")


class Demo(StageConfig):
    epochs: int = Field(2, description="passes over the data")
    mode: Literal["frozen", "lora"] = Field("frozen", description="backbone mode")
    optim: Inner = Field(default_factory=Inner, description="optimiser")


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 3\noptim:\n  lr: 0.01\n")
    cfg = load_config(Demo, path, ["optim.lr=0.5", "mode=lora"])
    assert cfg.epochs == 3 and cfg.optim.lr == 0.5 and cfg.mode == "lora"


def test_unknown_and_wrong_type_name_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochz: 3\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown field 'epochz'"):
        load_config(Demo, path)
    with pytest.raises(ConfigError, match=r"field 'optim.lr': .*got \"fast\""):
        load_config(Demo, None, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"field 'mode'"):
        load_config(Demo, None, ["mode=full"])
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides({}, ["epochs"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Demo, tmp_path / "missing.yaml")


def test_describe_lists_nested_fields():
    rows = {name: (kind, default, doc) for name, kind, default, doc in describe_config(Demo)}
    assert rows["optim.lr"] == ("float", "0.0001", "learning rate")
    assert rows["epochs"][2] == "passes over the data"
