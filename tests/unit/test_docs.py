"""The README as a front door and the release notes, checked against the code:
- the README has at most 250 lines, and every relative link in it names a file of the tree;
- its configuration table lists every `SDP4BitConfig` field in order, with its default, and in
  each preset's column exactly the values that preset changes (so the table cannot drift from
  `lightning_sdp4bit/config.py`; the docs site generates its own from the field docstrings);
- CHANGELOG.md is release notes: `[Unreleased]` above the released `[0.1.0]`, entries of a line or
  two under Keep a Changelog's headings, under 25 KB.
The docs site itself is checked by `make docs` (mkdocs in strict mode)."""

import re
from pathlib import Path

from lightning_sdp4bit.config import PRESETS, SDP4BitConfig

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if "://" not in t]
    assert local, "no relative links found"
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def _config_table():
    lines = [line for line in README.splitlines() if line.startswith("| `") or line.startswith("| field |")]
    header = next(line for line in lines if line.startswith("| field | default"))
    columns = [cell.strip().strip("`").split(" ")[0] for cell in header.strip("|").split("|")]
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        name = cells[0].strip("`")
        if name in SDP4BitConfig.field_names():
            rows[name] = dict(zip(columns, (c.strip("`") for c in cells), strict=True))
    return columns, rows


def _text(value):
    return {True: "true", False: "false"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def test_readme_configuration_table_matches_the_config():
    columns, rows = _config_table()
    assert list(rows) == SDP4BitConfig.field_names()
    defaults = SDP4BitConfig().to_dict()
    presets = [c for c in columns if c in PRESETS]
    assert set(presets) | {"sdp4bit"} == set(PRESETS)
    for name, row in rows.items():
        assert row["default"] == _text(defaults[name]), name
        for preset in presets:
            value = SDP4BitConfig.preset(preset).to_dict()[name]
            expected = "" if value == defaults[name] else _text(value)
            assert row[preset] == expected, (preset, name)


def test_changelog_is_release_notes_with_unreleased_changes_on_top():
    text = (REPO / "CHANGELOG.md").read_text()
    sections = re.findall(r"^## \[([^\]]+)\](.*)$", text, flags=re.M)
    assert [name for name, _ in sections][:2] == ["Unreleased", "0.1.0"]
    assert re.match(r" - \d{4}-\d{2}-\d{2}$", sections[1][1])
    unreleased = text.split("## [Unreleased]", 1)[1].split("## [0.1.0]", 1)[0]
    headings = re.findall(r"^### (.+)$", unreleased, flags=re.M)
    assert set(headings) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, headings
    # Entries, not stories: each a line or two (a third for a long list of names at most).
    entries = re.findall(r"^- .*(?:\n  .*)*", unreleased, flags=re.M)  # a bullet and its indented lines
    assert all(len(entry.splitlines()) <= 3 for entry in entries), entries
    assert len(text.encode()) < 25_000
