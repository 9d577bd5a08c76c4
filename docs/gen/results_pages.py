"""The results pages, generated from `results/` at build time.

One page per result file: a benchmark suite's `results/**/<suite>.json` (`{"suite",
"created", "machine", "contended", "rows": [{name, value, unit, better, paper, target,
meets}], "notes"}`), with its table, notes, machine and date, the suite's report
`<suite>.md` where one lies beside it, and its plot `<suite>.png`; and a simulation's
`results/**/simulate.json` (`scaleout simulate --out DIR`), with its rows and plot. Other
JSON files there (the calibration, per-run records) are not results pages. It also copies
the narrative notes in `results/*.md` into the development log.

`mkdocs build` runs this file (mkdocs-gen-files); it writes `results/SUMMARY.md` (the
section's navigation), `results/index.md`, a page per result and the PNG beside it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

RESULTS = Path("results")
# narrative notes in results/ that belong to the development log: (source, page, title)
NARRATIVE = (
    ("measurements.md", "dev-log/measurements.md", "Measurements behind the design"),
    ("simulator_checks.md", "dev-log/simulator-checks.md", "The simulator's demo checks"),
)


def result_files(root: Path = RESULTS) -> list[tuple[Path, str]]:
    """(path, kind) of every result file under `root`: kind "suite" or "simulate"."""
    found = []
    for path in sorted(root.rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            continue
        if "suite" in doc:
            found.append((path, "suite"))
        elif "config" in doc and "sweep" in doc:
            found.append((path, "simulate"))
    return found


def page_path(path: Path, root: Path = RESULTS) -> str:
    """The page of a result file: `results/<its path under results/, .json -> .md>`."""
    return "results/" + path.relative_to(root).with_suffix(".md").as_posix()


def title(path: Path, doc: dict[str, Any], root: Path = RESULTS) -> str:
    name = path.relative_to(root).with_suffix("").as_posix()
    if "suite" in doc:
        label = f"Suite {doc['suite']}"
        return label if name == doc["suite"] else f"{label} ({name})"
    return f"Simulation ({path.parent.relative_to(root).as_posix() or name})"


# --- formatting -------------------------------------------------------------------------------


def number(value: Any) -> str:  # noqa: ANN401
    """A figure to 4 significant digits, with thousands separators."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, int | float):
        return cell(str(value))
    if value == 0:
        return "0"
    if isinstance(value, int) or (abs(value) >= 1000 and float(value).is_integer()):
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def cell(text: str) -> str:
    """Markdown for a table cell."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("|", "\\|").replace("\n", " ")


def meets(row: dict[str, Any]) -> str:
    value = row.get("meets")
    return "" if value is None else ("met" if value else "**missed**")


def machine_lines(machine: dict[str, Any]) -> list[str]:
    lines = [
        f"- machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
        f"torch {machine.get('torch', '?')}"
    ]
    for key, value in machine.items():
        if key in ("cpu", "cores", "torch", "checks"):
            continue
        lines.append(f"- {key}: {cell(json.dumps(value) if not isinstance(value, str) else value)}")
    checks = machine.get("checks")
    if checks:
        ratios = ", ".join(f"{c['ratio']:.2f}x" for c in checks)
        quiet = all(c.get("quiet") for c in checks)
        lines.append(
            f"- machine checks (two 1-thread processes against one, before and after): "
            f"{ratios}, {'quiet' if quiet else 'another load was running'}"
        )
    return lines


def suite_markdown(path: Path, doc: dict[str, Any], png: str | None, report: str | None) -> str:
    rows = doc["rows"]
    targets = [r for r in rows if r.get("meets") is not None]
    met = sum(1 for r in targets if r["meets"])
    out = [f"# {title(path, doc)}", ""]
    out += [
        f"- file: `{path.as_posix()}`",
        f"- created: {doc.get('created', 'not recorded')}",
        *machine_lines(doc.get("machine") or {}),
        f"- contended: {'yes' if doc.get('contended') else 'no'}"
        if "contended" in doc
        else "- contended: not recorded",
        f"- rows: {len(rows)}; with a target: {len(targets)}, met: {met}",
        f"- run it again: `python -m benchmarks {doc['suite']}`",
        "",
    ]
    if png:
        out += [f"![{doc['suite']}]({png})", ""]
    notes = doc.get("notes") or []
    if notes:
        out += ["## Notes", ""] + [f"- {cell(str(n))}" for n in notes] + [""]
    out += ["## Rows", ""]
    out += ["| name | value | unit | better | paper | target | meets |"]
    out += ["| --- | ---: | --- | --- | ---: | ---: | --- |"]
    for row in rows:
        out.append(
            f"| {cell(str(row.get('name', '')))} | {number(row.get('value'))} | "
            f"{cell(str(row.get('unit', '')))} | {row.get('better', '')} | "
            f"{number(row.get('paper'))} | {number(row.get('target'))} | {meets(row)} |"
        )
    out.append("")
    if report:
        out += ["## Report", "", _demote(report), ""]
    return "\n".join(out)


def _demote(markdown: str) -> str:
    """A report's headings below the page's `##`: the shallowest becomes `###`."""
    levels = [len(m) for m in re.findall(r"^(#+) ", markdown, flags=re.M)]
    if not levels:
        return markdown
    shift = 3 - min(levels)
    return re.sub(
        r"^(#+) ", lambda m: "#" * max(1, len(m.group(1)) + shift) + " ", markdown, flags=re.M
    )


SIM_COLUMNS = (
    ("machines", "machines"),
    ("replicas", "replicas"),
    ("shards", "shards"),
    ("examples_per_s", "examples/s"),
    ("steady_examples_per_s", "steady examples/s"),
    ("step_s", "s per step"),
    ("bottleneck", "bottleneck"),
    ("wire_bytes", "bytes on the wire"),
    ("staleness_mean", "staleness (mean)"),
)


def simulate_markdown(path: Path, doc: dict[str, Any], png: str | None) -> str:
    rows = doc["rows"]
    swept = [s.split("=", 1)[0] for s in doc.get("sweep") or []]
    columns = [(k, k) for k in swept] + [c for c in SIM_COLUMNS if any(c[0] in r for r in rows)]
    out = [f"# {title(path, doc)}", ""]
    out += [
        f"- file: `{path.as_posix()}`",
        f"- config: `{doc.get('config')}`",
        f"- link: {doc.get('link')}",
        f"- calibration: `{doc.get('calibration')}`",
        f"- sweep: {', '.join(f'`{s}`' for s in doc.get('sweep') or []) or 'none'}",
        f"- overrides: {', '.join(f'`{s}`' for s in doc.get('overrides') or []) or 'none'}",
        "- created and machine: not recorded in a simulation's file",
        "- written by `scaleout simulate` (see [Predict a run](../how-to/simulate.md))"
        if path.parent == RESULTS
        else "- written by `scaleout simulate` (see [Predict a run](../../how-to/simulate.md))",
        "",
    ]
    if png:
        out += [f"![simulation]({png})", ""]
    out += ["## Rows", ""]
    out.append("| " + " | ".join(label for _, label in columns) + " | utilisation |")
    out.append("| " + " | ".join("---" for _ in columns) + " | --- |")
    for row in rows:
        busy = row.get("utilisation") or {}
        used = ", ".join(f"{k} {100 * v:.0f}%" for k, v in busy.items())
        values = [number(row.get(key)) for key, _ in columns]
        out.append("| " + " | ".join(values) + f" | {cell(used)} |")
    out.append("")
    return "\n".join(out)


def index_markdown(pages: list[tuple[str, Path, dict[str, Any]]]) -> str:
    out = [
        "# Results",
        "",
        "Every result file in `results/`, as the benchmark suites (`python -m benchmarks "
        "SUITE`) and `scaleout simulate` wrote it, one page each with its table, notes and "
        "plot. These pages are generated from the files when the site is built "
        "(`docs/gen/results_pages.py`). A suite's figures were measured together in one run "
        "on the machine named on its page; compare ratios within a page, not absolute "
        "figures across pages. The story of how the figures came about is in the "
        "[development log](../dev-log.md).",
        "",
        "| page | created | rows | targets met | contended |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for page, path, doc in pages:
        link = page.removeprefix("results/")
        targets = [r for r in doc["rows"] if r.get("meets") is not None]
        met = f"{sum(1 for r in targets if r['meets'])} of {len(targets)}" if targets else ""
        contended = "yes" if doc.get("contended") else ("no" if "contended" in doc else "")
        created = doc.get("created", "")
        out.append(
            f"| [{title(path, doc)}]({link}) | {created} | {len(doc['rows'])} | {met} | "
            f"{contended} |"
        )
    return "\n".join(out) + "\n"


def write_pages() -> None:
    import mkdocs_gen_files

    pages: list[tuple[str, Path, dict[str, Any]]] = []
    for path, kind in result_files():
        doc = json.loads(path.read_text())
        page = page_path(path)
        png_path = path.with_suffix(".png")
        png = None
        if png_path.exists():
            png = png_path.name
            with mkdocs_gen_files.open(str(Path(page).with_suffix(".png")), "wb") as out:
                out.write(png_path.read_bytes())
        report_path = path.with_suffix(".md")
        report = report_path.read_text() if report_path.exists() and kind == "suite" else None
        if kind == "suite":
            text = suite_markdown(path, doc, png, report)
        else:
            text = simulate_markdown(path, doc, png)
        with mkdocs_gen_files.open(page, "w") as out:
            out.write(text)
        pages.append((page, path, doc))
    with mkdocs_gen_files.open("results/index.md", "w") as out:
        out.write(index_markdown(pages))
    with mkdocs_gen_files.open("results/SUMMARY.md", "w") as out:
        out.write("* [Overview](index.md)\n")
        for page, path, doc in pages:
            out.write(f"* [{title(path, doc)}]({page.removeprefix('results/')})\n")
    _not_a_page("results/SUMMARY.md")
    for source, page, heading in NARRATIVE:
        path = RESULTS / source
        if not path.exists():
            continue
        text = path.read_text()
        intro = (
            f"*Copied from `results/{source}` when the site is built. Commands in it are as "
            "they were run at the time: benchmarks now run as `python -m benchmarks SUITE`.*"
        )
        if text.startswith("# "):
            first, _, rest = text.partition("\n")
            text = f"{first}\n\n{intro}\n{rest}"
        else:
            text = f"# {heading}\n\n{intro}\n\n{text}"
        with mkdocs_gen_files.open(page, "w") as out:
            out.write(text)


def _not_a_page(name: str) -> None:
    """A generated navigation file: read by literate-nav, not built as a page (as
    `exclude_docs` does for the hand-written ones)."""
    import mkdocs_gen_files
    from mkdocs.structure.files import InclusionLevel

    file = mkdocs_gen_files.FilesEditor.current().files.get_file_from_path(name)
    if file is not None:
        file.inclusion = InclusionLevel.EXCLUDED


if __name__ in ("__main__", "<run_path>"):
    write_pages()
