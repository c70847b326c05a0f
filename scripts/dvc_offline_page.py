"""Write the offline page of `dvc plots show`: .dvc/plots/offline.html and its .dvc/plots/NOTICE.

DVC's own page (dvc_render/html.py) loads vega, vega-lite and vega-embed from a CDN through its
scripts placeholder, so without a network it renders blank. The page written here inlines the three
libraries instead, taken from the copies Snakemake ships for its reports (snakemake/assets/data, which
records each file's source URL, version and sha256 in snakemake/assets/__init__.py), and leaves that
placeholder out, so DVC's CDN tags have nowhere to go. .dvc/config sets it as `plots.html_template`.

The three are BSD-3-Clause (University of Washington Interactive Data Lab); their bundles also hold
code of the packages listed below, each under its own licence. NOTICE reproduces every one of those
licences, as the BSD, MIT and ISC terms ask of a redistribution.

    .venv/bin/python scripts/dvc_offline_page.py          # rewrite both files
    .venv/bin/python scripts/dvc_offline_page.py --check  # exit 1 if they differ from what it would write
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / ".dvc" / "plots" / "offline.html"
NOTICE = REPO / ".dvc" / "plots" / "NOTICE"

# Library -> the packages its bundle includes, as snakemake/assets/__init__.py lists them (from each
# library's yarn.lock at that version).
LIBRARIES: dict[str, list[str]] = {
    "vega": ["d3-array", "d3-format", "d3-time-format", "d3-time", "d3-interpolate", "d3-color", "d3-scale",
             "@types-estree", "d3-force", "d3-dispatch", "d3-quadtree", "d3-timer", "d3-geo", "d3-hierarchy",
             "d3-dsv", "topojson-client", "d3-geo-projection", "d3-path", "d3-shape", "d3-delaunay",
             "delaunator", "hashlru", "d3-regression", "regression", "science", "quickselect", "commons-math",
             "esprima", "fabric", "d3-contour", "shapefile"],
    "vega-lite": ["@types-clone", "array-flat-polyfill", "clone", "fast-deep-equal", "fast-json-stable-stringify",
                  "json-stringify-pretty-compact"],
    "vega-embed": ["fast-json-patch", "semver", "vega-schema-url-parser", "vega-themes", "vega-tooltip"],
}

# dvc_render substitutes these in the page; the plots' divs call `vegaEmbed(...)` (dvc_render/vega.py).
PLOTS_PLACEHOLDER = "{plot_divs}"
REFRESH_PLACEHOLDER = "{refresh_tag}"


def assets() -> tuple[Path, dict[str, str]]:
    """Snakemake's asset folder and the version of each asset file (`<package>/<file>` -> version)."""
    try:
        from snakemake.assets import Assets
    except ImportError as e:
        sys.exit(f"dvc_offline_page: snakemake is not installed in this environment ({e}); run `make install`")
    import snakemake.assets as module

    return Path(module.__file__).parent / "data", {k: v.version or "" for k, v in Assets.spec.items()}


def licence_files(data: Path, package: str) -> list[Path]:
    files = sorted(p for p in (data / package).iterdir() if not p.name.endswith((".js", ".css")))
    if not files:
        sys.exit(f"dvc_offline_page: no licence file for {package} under {data / package}")
    return files


def render() -> tuple[str, str]:
    """(page, notice) from the installed assets."""
    data, versions = assets()
    scripts, notice = [], [
        "The offline page of `dvc plots show` (.dvc/plots/offline.html, written by scripts/dvc_offline_page.py)",
        "inlines vega, vega-lite and vega-embed as Snakemake ships them (snakemake/assets/data). Their",
        "licences and those of the packages their bundles include follow.",
        "",
    ]
    for lib, bundled in LIBRARIES.items():
        js = data / lib / f"{lib}.js"
        if not js.is_file():
            sys.exit(f"dvc_offline_page: {js} not found (snakemake's assets changed?)")
        code = js.read_text(encoding="utf-8")
        # An inline script ends at the first "</script"; none of the three holds one, and a later
        # version that did would cut the page short without a word.
        if "</script" in code.lower():
            sys.exit(f"dvc_offline_page: {js} contains '</script', which would end the inline script early")
        if PLOTS_PLACEHOLDER in code or REFRESH_PLACEHOLDER in code:
            sys.exit(f"dvc_offline_page: {js} contains a dvc_render placeholder")
        version = versions.get(f"{lib}/{lib}.js", "")
        scripts.append(f"<script>/* {lib} {version}, BSD-3-Clause: see .dvc/plots/NOTICE */\n{code}\n</script>")
        for package in [lib, *bundled]:
            for f in licence_files(data, package):
                ver = versions.get(f"{package}/{f.name}", "")
                title = f"{package} {ver}".strip() + (f" (in {lib}.js)" if package != lib else "")
                notice += ["=" * 100, f"{title}: {f.name}", "=" * 100, f.read_text(encoding="utf-8").rstrip(), ""]
    page = "\n".join([
        "<!DOCTYPE html>",
        "<html>",
        "<head>",
        '<meta charset="utf-8">',
        REFRESH_PLACEHOLDER,
        "<title>DVC plots</title>",
        "<!-- Written by scripts/dvc_offline_page.py: vega, vega-lite and vega-embed inline, so the page",
        "     renders without a network; DVC's CDN script tags are left out on purpose. -->",
        *scripts,
        "<style>table { border-spacing: 15px; } body { font-family: sans-serif; }</style>",
        "</head>",
        "<body>",
        PLOTS_PLACEHOLDER,
        "</body>",
        "</html>",
        "",
    ])
    return page, "\n".join(notice)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if .dvc/plots/offline.html or NOTICE differ from what would be written")
    args = parser.parse_args()
    page, notice = render()
    if args.check:
        stale = [str(p.relative_to(REPO)) for p, text in ((PAGE, page), (NOTICE, notice))
                 if not p.is_file() or p.read_text(encoding="utf-8") != text]
        if stale:
            print(f"dvc_offline_page: {', '.join(stale)} out of date; run .venv/bin/python scripts/dvc_offline_page.py")
            return 1
        return 0
    sys.path.insert(0, str(REPO))
    from pipeline.files import atomic_write_text

    for path, text in ((PAGE, page), (NOTICE, notice)):
        atomic_write_text(path, text)
        path.chmod(0o644)   # a temp file's 0600 otherwise: the page is opened by whoever reads the plots
    print(f"dvc_offline_page: wrote {PAGE.relative_to(REPO)} ({len(page) / 1e6:.1f} MB) and {NOTICE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
