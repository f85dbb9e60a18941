"""The settings in config.py are the one description of each variable: README's configuration
table and docs/configuration.md are written from them by scripts/gen_config_docs.py, and are
stale the moment a setting's meaning changes without them. Each short meaning fits one table line;
every link in the long meanings lands on a heading that exists."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gen_config_docs as gen  # noqa: E402

from vllm_omni_graphdecode import config  # noqa: E402


def test_readme_table_and_configuration_page_are_written_from_the_settings():
    stale = gen.stale()
    assert not stale, f"{', '.join(stale)} stale against config.py: run {gen.COMMAND}"


def test_a_changed_meaning_makes_both_pages_stale(monkeypatch):
    first = dataclasses.replace(config.SETTINGS[0], short="Something else.")
    monkeypatch.setattr(config, "SETTINGS", (first,) + config.SETTINGS[1:])
    assert gen.stale() == ["README.md", "docs/configuration.md"]


def test_each_short_meaning_is_one_table_line_of_at_most_160_characters():
    for s in config.SETTINGS:
        assert len(s.short) <= 160, (s.var, len(s.short))
        assert "\n" not in s.short and "|" not in s.short, s.var
        assert s.long, s.var  # the page has more to say than the table


def test_each_variable_says_what_it_accepts_as_start_up_does():
    for s in config.SETTINGS:
        assert gen.accepted(s), s.var
    tokens = next(s for s in config.SETTINGS if s.var == config.TOKENS_PER_LAUNCH_VAR)
    assert gen.accepted(tokens) == "an integer from 1 to 64"


def _anchors(path):
    with open(path) as f:
        heads = [line.lstrip("#").strip() for line in f if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_every_link_in_the_long_meanings_lands_on_a_heading():
    for s in config.SETTINGS:
        for page, anchor in re.findall(r"\]\(([\w.-]+\.md)(?:#([\w-]+))?\)", s.long):
            path = os.path.join(ROOT, "docs", page)
            assert os.path.exists(path), (s.var, page)
            if anchor:
                assert anchor in _anchors(path), (s.var, page, anchor)
