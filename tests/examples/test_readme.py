"""``examples/README.md`` stays true: its client config loads, its commands name the example's real code."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from hetfed_example import data, lora, models

from hetfed.client.config import load_client_config

README = Path(__file__).resolve().parents[2] / "examples" / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_the_client_config_in_the_readme_loads(tmp_path: Path) -> None:
    (block,) = _blocks("toml")
    tomllib.loads(block)
    (tmp_path / "client.toml").write_text(block)
    cfg = load_client_config(tmp_path / "client.toml")
    assert cfg.model.builder == "hetfed_example.models:dsconv"
    assert (cfg.data.dataset, cfg.data.factory) == ("torch", "hetfed_example.data:fashion_folder")


def test_every_reference_in_the_readme_names_a_function_of_the_example() -> None:
    modules = {"models": models, "data": data, "lora": lora}
    refs = set(re.findall(r"hetfed_example\.(models|data|lora):(\w+)", README.read_text()))
    assert {("models", "resnet"), ("models", "dsconv"), ("models", "mixer"), ("data", "fashion_folder"),
            ("lora", "lora_cnn"), ("lora", "full_cnn")} <= refs
    for module, name in refs:
        assert callable(getattr(modules[module], name)), f"{module}:{name}"
