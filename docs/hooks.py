"""MkDocs hooks of the docs site (mkdocs.yml names this file; `make docs` builds with them).

- The API reference finds the whole installed package. `strategies/` and `kernels/` live at the
  repository's top level and install as `lightning_sdp4bit.strategies` and `.kernels` through a
  package-dir mapping, which griffe's static loader does not follow. `on_config` asks the
  installed package where each of the three lives (`importlib.util.find_spec`, which imports only
  the light `lightning_sdp4bit/__init__.py`) and copies the sources into
  `build/docs-api/lightning_sdp4bit/` in the installed shape; mkdocstrings reads them there.
- The configuration reference is generated, not written: `on_page_markdown` replaces the
  `<!-- sdp4bit:config-fields -->` and `<!-- sdp4bit:config-presets -->` markers of
  configuration.md with tables built from `SDP4BitConfig`'s field docstrings (read by griffe, the
  loader mkdocstrings uses), its defaults and `PRESETS`. A field without a docstring fails the build.
- Lists right after a paragraph line, as GitHub renders them, are lists here too: Python-Markdown
  needs a blank line before a list, which the repository's Markdown files and docstrings do not
  keep. `ListAfterParagraph` adds it, for the pages and (through mkdocstrings, which uses the same
  extensions) the docstrings; it is added first, before the plugins read the extension list.
- The dated results under `benchmarks/results/` (listed in the nav under Performance),
  `benchmarks/README.md` and `CHANGELOG.md` are pages of the site (`results/...`,
  `benchmarks.md`, `changelog.md`), so that the docs link to them and strict mode checks those
  links too. benchmarks/README.md's links into `../docs/` are rewritten to the site's root.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import re
import shutil
from pathlib import Path

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
API_SOURCES = ROOT / "build" / "docs-api"
FIELDS_MARKER = "<!-- sdp4bit:config-fields -->"
PRESETS_MARKER = "<!-- sdp4bit:config-presets -->"


def _stage_api_sources() -> None:
    """build/docs-api/lightning_sdp4bit/: a copy of the installed package's sources in their
    installed shape, the two mapped subpackages included (griffe follows symbolic links back to
    the real folders, so the files are copied: about 1 MB)."""
    package = Path(importlib.util.find_spec("lightning_sdp4bit").submodule_search_locations[0])
    mapped = {
        name: Path(importlib.util.find_spec(f"lightning_sdp4bit.{name}").submodule_search_locations[0])
        for name in ("strategies", "kernels")
    }
    staged = API_SOURCES / "lightning_sdp4bit"
    shutil.rmtree(API_SOURCES, ignore_errors=True)
    skip = shutil.ignore_patterns("__pycache__", *mapped)
    shutil.copytree(package, staged, ignore=skip)
    for name, path in mapped.items():
        shutil.copytree(path, staged / name, ignore=shutil.ignore_patterns("__pycache__"))


_BULLET = re.compile(r"^\s*[-*+] ")
_NUMBERED = re.compile(r"^\s*\d+\. ")


class _BlankBeforeLists(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        fenced = False
        for line in lines:
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            previous = out[-1] if out else ""
            starts_list = _BULLET.match(line) or (_NUMBERED.match(line) and previous.rstrip().endswith(":"))
            in_paragraph = previous.strip() and not previous.startswith((" ", "\t", "|", "#", ">"))
            in_list = _BULLET.match(previous) or _NUMBERED.match(previous)
            if not fenced and starts_list and in_paragraph and not in_list:
                out.append("")
            out.append(line)
        return out


class ListAfterParagraph(Extension):
    def extendMarkdown(self, md) -> None:
        md.preprocessors.register(_BlankBeforeLists(md), "sdp4bit_blank_before_lists", 40)


def _results_in_nav(nav: list) -> None:
    """Performance > Dated results: one entry per summary, newest last, named by its file."""
    for section in nav:
        if isinstance(section, dict) and "Performance" in section:
            by_date = lambda path: (path.stem.rsplit("_", 1)[-1], path.stem)  # noqa: E731
            summaries = sorted((ROOT / "benchmarks" / "results").glob("*.md"), key=by_date)
            section["Performance"].append({"Dated results": [{p.stem: f"results/{p.name}"} for p in summaries]})


@event_priority(100)  # before mkdocstrings reads the extension list
def on_config(config, **kwargs):
    _stage_api_sources()
    config.markdown_extensions.append(ListAfterParagraph())
    _results_in_nav(config.nav)
    return config


def on_files(files: Files, config, **kwargs) -> Files:
    """Add the dated results, the benchmarks' README and the changelog as pages."""
    results = ROOT / "benchmarks" / "results"
    for path in sorted(results.glob("*.md")):
        files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    files.append(File.generated(config, "benchmarks.md", abs_src_path=str(ROOT / "benchmarks" / "README.md")))
    files.append(File.generated(config, "changelog.md", abs_src_path=str(ROOT / "CHANGELOG.md")))
    return files


def _value(value) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"`{value:_}`"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _cell(text: str) -> str:
    """A docstring as one Markdown table cell."""
    return " ".join(line.strip() for line in text.strip().splitlines()).replace("|", "\\|")


def _fields_table() -> str:
    import griffe

    import lightning_sdp4bit.config as config_module
    from lightning_sdp4bit.config import SDP4BitConfig

    module = griffe.load("lightning_sdp4bit.config", search_paths=[str(API_SOURCES)])
    documented = module["SDP4BitConfig"].members
    rows = ["| field | type | default | allowed | what it does |", "|---|---|---|---|---|"]
    for field in dataclasses.fields(SDP4BitConfig):
        member = documented.get(field.name)
        if member is None or member.docstring is None:
            raise ValueError(f"SDP4BitConfig.{field.name} has no docstring: the configuration reference needs one")
        annotation = str(member.annotation)
        enum_type = getattr(config_module, annotation, None)
        if isinstance(enum_type, type) and issubclass(enum_type, enum.Enum):
            allowed = ", ".join(f"`{m.value!r}`" for m in enum_type)
            annotation = "str"
        elif field.name.endswith("_bits"):
            allowed = ", ".join(f"`{b}`" for b in config_module.ALLOWED_BITS)
        else:
            allowed = "see the text"
        annotation = annotation.replace(" | ", " or ")  # a pipe would split the table's cell
        rows.append(
            f"| `{field.name}` | {annotation} | {_value(field.default)} | {allowed} | {_cell(member.docstring.value)} |"
        )
    return "\n".join(rows)


def _presets_table() -> str:
    from lightning_sdp4bit.config import PRESETS, SDP4BitConfig

    default = SDP4BitConfig().to_dict()
    rows = ["| preset | differs from the defaults in |", "|---|---|"]
    for name in PRESETS:
        changed = {k: v for k, v in SDP4BitConfig.preset(name).to_dict().items() if v != default[k]}
        text = ", ".join(f"`{k}={v}`" for k, v in changed.items()) or "nothing: the defaults"
        rows.append(f"| `{name}` | {text} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if page.file.src_uri == "benchmarks.md":  # benchmarks/README.md: its ../docs/ is the site's root
        markdown = markdown.replace("](../docs/", "](")
    if FIELDS_MARKER in markdown:
        markdown = markdown.replace(FIELDS_MARKER, _fields_table())
    if PRESETS_MARKER in markdown:
        markdown = markdown.replace(PRESETS_MARKER, _presets_table())
    return markdown
