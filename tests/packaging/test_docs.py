"""The documentation: the reference pages made from the code match it, and the README stays short and true.

The site's strict build (broken links and anchors) runs in `make check-docs`, part of `make test`.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from types import ModuleType

import pytest

from weightstream.cli import build_parser
from weightstream_server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 150


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    """The fenced code blocks of text in one of languages."""
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if m.group(1) in languages]


def test_reference_pages_match_the_code() -> None:
    problems = _generator().drift()
    assert not problems, "docs/reference is out of date: run `make docs`\n" + "\n".join(problems)


def test_every_server_option_and_metric_is_on_its_page() -> None:
    options = (ROOT / "docs" / "reference" / "options.md").read_text()
    for name in ServerSettings.model_fields:
        assert f"`WEIGHTSTREAM_{name.upper()}`" in options, name
    metrics_source = (ROOT / "service" / "weightstream_server" / "ops" / "metrics.py").read_text()
    metrics = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    families = _generator().metric_families(metrics_source)
    for family in families:
        assert f"`{family.name}`" in metrics, family.name
    # Every name metrics.py spells (PREFIX + "...", or the disk cache's prefix + "...") was found by the generator.
    found = {f.name.removeprefix("weightstream_").removesuffix("_total") for f in families}
    spelt = {m.group(2) for m in re.finditer(r'\b(PREFIX|disk) \+ "(\w+)"', metrics_source) if m.group(1) == "PREFIX"}
    spelt |= {"disk_cache_" + m.group(1) for m in re.finditer(r'\bdisk \+ "(\w+)"', metrics_source)}
    spelt.discard("disk_cache_")
    assert spelt and spelt == found, spelt ^ found


def test_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing


def _commands(text: str) -> list[list[str]]:
    """Each command line of the shell blocks of text, comments and continuation lines joined."""
    commands = []
    for block in _blocks(text, ("sh", "bash")):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                words = words[1:]
            if words:
                commands.append(words)
    return commands


def test_readme_commands_parse() -> None:
    """Every `weightstream` command parses, with valid server settings; every make target, extra, path and
    file the other commands name exists."""
    makefile = (ROOT / "Makefile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    seen = set()
    for words in _commands(README.read_text()):
        seen.add(words[0])
        if words[0] == "weightstream":
            args = build_parser().parse_args(words[1:])
            if args.command == "serve":
                ServerSettings.load(vars(args), environ={})
        elif words[0] == "make":
            for target in words[1:]:
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), target
        elif words[:2] == ["pip", "install"]:
            for requirement in words[2:]:
                extras = re.fullmatch(r"weightstream(?:\[(.*)\])?", requirement)
                assert extras, requirement
                for extra in filter(None, (extras.group(1) or "").split(",")):
                    assert re.search(rf"^{extra} = \[", pyproject, re.M), extra
        elif words[0] == "kubectl":
            assert (ROOT / words[words.index("-k") + 1] / "kustomization.yaml").is_file()
        elif words[:2] == ["docker", "compose"]:
            assert (ROOT / words[words.index("-f") + 1]).is_file()
    assert {"make", "weightstream", "kubectl"} <= seen


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_python_examples_compile(page: str) -> None:
    for block in _blocks((ROOT / page).read_text(), ("python",)):
        compile(block, page, "exec")


def test_every_rpc_is_on_the_wire_page() -> None:
    proto = (ROOT / "proto" / "weightstream" / "v1" / "weightstream.proto").read_text()
    wire = (ROOT / "docs" / "reference" / "wire.md").read_text()
    rpcs = re.findall(r"^\s*rpc (\w+)", proto, re.M)
    assert rpcs
    assert not [rpc for rpc in rpcs if f"`{rpc}" not in wire]
