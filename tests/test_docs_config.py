"""Every configuration field is documented where a user looks for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hetfed.aggregator.config import RunConfig, SeedSetConfig, ServerConfig
from hetfed.cli.experiments import docs_page
from hetfed.client.config import ClientConfig, ModelConfig, RetryConfig
from hetfed.client.data import DataConfig
from hetfed.client.privacy.config import PrivacyConfig
from hetfed.wire.specs import SPECS, TrainConfig
from hetfed.wire.transport import TlsConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"
BASE = {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize("cls", [ServerConfig, RunConfig, SeedSetConfig, ClientConfig, ModelConfig, RetryConfig,
                                 DataConfig, TlsConfig, TrainConfig, PrivacyConfig], ids=lambda c: c.__name__)
def test_core_fields_documented(cls: type) -> None:
    text = (DOCS / "configuration.md").read_text()
    missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in text]
    assert missing == [], f"document {cls.__name__} fields {missing} in docs/configuration.md"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_algorithm_fields_documented(name: str) -> None:
    extra = [f.name for f in dataclasses.fields(SPECS[name].config_type) if f.name not in BASE]
    # The spec's own page (variants registered under other names share their algorithm's), else algorithms/<name>.md.
    page = DOCS / docs_page(SPECS[name])
    text = page.read_text() if page.exists() else (DOCS / "configuration.md").read_text()
    missing = [f for f in extra if f"`{f}`" not in text]
    assert missing == [], f"document {name} fields {missing}"
