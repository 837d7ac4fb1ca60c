"""`helm lint` and `helm template` of a local chart, through Helm's own Go code, without the helm binary.

The dev extra installs helm-python-sdk, a wheel that binds Helm's Go SDK (its lint and render
actions) as a shared library: no Go toolchain, no download outside PyPI. make check-deploy runs

    python scripts/helm_chart.py lint CHART [-f VALUES]...
    python scripts/helm_chart.py template RELEASE CHART [-n NAMESPACE] [-f VALUES]... > manifests.yaml

lint is strict (warnings fail, as `helm lint --strict`); template prints the rendered manifests as
`helm template` does, one `# Source:` document each, without NOTES.txt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import helm_python
import yaml

SEVERITIES = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}


def merged_values(files: list[Path]) -> dict[str, Any]:
    """The values files merged left to right, maps deeply and everything else replaced, as helm -f does."""
    merged: dict[str, Any] = {}
    for path in files:
        _merge(merged, yaml.safe_load(path.read_text()) or {})
    return merged


def _merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def lint(chart: Path, files: list[Path]) -> list[str]:
    """The problems `helm lint --strict` reports (warnings and errors), one line each."""
    report = helm_python.lint(str(chart), merged_values(files) or None, strict=True)
    problems = [
        f"[{SEVERITIES.get(m['severity'], m['severity'])}] {m['path']}: {m['error']}"
        for m in report.get("messages", [])
        if m["severity"] >= 2
    ]
    return problems + [str(e) for e in report.get("errors") or []]


def template(release: str, chart: Path, namespace: str, files: list[Path]) -> dict[str, str]:
    """The rendered manifests by template path (NOTES.txt and templates that render empty left out)."""
    rendered = helm_python.Chart.load(str(chart)).render(
        merged_values(files) or None, name=release, namespace=namespace, is_install=True
    )
    return {
        path: text
        for path, text in sorted(rendered.items())
        if not path.endswith("NOTES.txt") and any(yaml.safe_load_all(text))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    lint_parser = commands.add_parser("lint", help="helm lint --strict CHART")
    lint_parser.add_argument("chart", type=Path)
    lint_parser.add_argument("-f", "--values", type=Path, action="append", default=[])
    template_parser = commands.add_parser("template", help="helm template RELEASE CHART")
    template_parser.add_argument("release")
    template_parser.add_argument("chart", type=Path)
    template_parser.add_argument("-n", "--namespace", default="default")
    template_parser.add_argument("-f", "--values", type=Path, action="append", default=[])
    args = parser.parse_args(argv)
    try:
        if args.command == "lint":
            problems = lint(args.chart, args.values)
            for problem in problems:
                print(problem, file=sys.stderr)
            given = " ".join(f"-f {f}" for f in args.values)
            print(f"helm lint --strict {args.chart} {given}: {len(problems)} problem(s)", file=sys.stderr)
            return 1 if problems else 0
        for path, text in template(args.release, args.chart, args.namespace, args.values).items():
            sys.stdout.write(f"---\n# Source: {path}\n{text.strip()}\n")
        return 0
    except helm_python.HelmError as exc:
        print(f"{args.command} {args.chart}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
