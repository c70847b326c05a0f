"""The documentation stays true: README.md and docs/ against their data, the registries and the repository.

1. The rendered blocks of README.md and docs/guide/*.md equal what scripts/render_docs.py renders
   from the committed data files, and a changed data value makes the check fail.
2. No measured number is written by hand outside a rendered block (render_docs.hand_written_numbers).
3. Every metric name and every `section.key` params key that README.md, the guides and
   architecture.md mention exists in the metric registry (pipeline/stages/metric_registry.py) and
   the params schema (pipeline/config.py).
4. No tracked file refers to an issue tracker, or speaks of the sessions that wrote it.
5. Every relative link of README.md and docs/ resolves to a file (and a heading, for an anchor).

Standard library and the project only; no stage runs, so the file takes seconds.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import re
import shutil
import subprocess
import sys
import typing
from functools import lru_cache
from pathlib import Path

import pytest

from conftest import load_script

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
GUIDE = REPO / "docs" / "guide"
DECISIONS = REPO / "docs" / "decisions"


def _load_renderer():
    return load_script(REPO / "scripts" / "render_docs.py")


render_docs = _load_renderer()


def rendered_pages() -> list[Path]:
    return render_docs.pages(REPO)


def all_doc_pages() -> list[Path]:
    """README.md and every Markdown file under docs/ (metrics.md and architecture.md included)."""
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def current_pages() -> list[Path]:
    """The pages that describe the project as it is: README.md, the guides and architecture.md, the
    pages with rendered blocks (docs/metrics.md is generated from the registry itself; a decision record is history)."""
    return rendered_pages()


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


# ---- 1. rendered blocks against their data ---------------------------------------------------------


@lru_cache(maxsize=None)
def committed_tree(checkout: Path = REPO) -> Path:
    """Where the pages and the data they were rendered from are read: the checkout, or, when its
    outputs/ hold a run of their own (`make pipeline` on a clone: dvc.lock's md5 of
    outputs/evaluate/metrics.json is not the one docs/data/committed-run.json names), HEAD's tracked
    files in a scratch folder. The pages describe the committed run; a user's run must not fail
    their check, and a run described with `make docs ARGS=--this-run` is checked in place."""
    run = json.loads((checkout / render_docs.COMMITTED_RUN).read_text())
    if render_docs.lock_md5(checkout, "outputs/evaluate/metrics.json") == run.get("evaluate_metrics_md5"):
        return checkout
    import tarfile
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="committed-tree."))
    archive = subprocess.run(["git", "-C", str(checkout), "archive", "HEAD"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        # the "data" filter where this Python has it (3.11.4 and later); git archive's own files either way
        tar.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return root


def test_the_pages_are_rendered_from_the_committed_data():
    root = committed_tree()
    differ = render_docs.render(root, check=True)
    assert not differ, f"rendered blocks differ from their data; run `make docs`: {differ}"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "render_docs.py"), "--check", "--root", str(root)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_run_of_your_own_is_checked_against_the_committed_pages(tmp_path):
    """After `make pipeline` on a clone, outputs/ and dvc.lock are the user's run: the pages are then
    checked against HEAD's committed data, not against that run (which they do not describe); a
    checkout whose run is the one committed-run.json names is checked in place."""
    clone = _copy_for_rendering(tmp_path)
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "committed run"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    assert committed_tree(clone) == clone
    lock = clone / "dvc.lock"
    committed = lock.read_text()
    theirs = render_docs.lock_md5(clone, "outputs/evaluate/metrics.json")
    lock.write_text(committed.replace(theirs, "f" * 32))                    # the user's own run
    (clone / "outputs/evaluate/metrics.json").write_text("{}")
    committed_tree.cache_clear()
    tree = committed_tree(clone)
    assert tree != clone and (tree / "dvc.lock").read_text() == committed
    assert not render_docs.render(tree, check=True)

def test_the_pages_have_the_blocks_they_should():
    """The README carries the demo and the headline; the guides the comparison and the frontier."""
    blocks = {rel(p): re.findall(r"<!-- rendered: ([\w-]+) -->", p.read_text()) for p in rendered_pages()}
    assert blocks["README.md"] == ["demo", "seeds", "headline"]
    assert blocks["docs/guide/methods.md"] == ["compare-run", "compare-seeds", "compare-sweeps", "grpo-sweep"]
    assert blocks["docs/guide/overoptimisation.md"] == ["frontier"]
    assert blocks["docs/guide/benchmarks.md"] == ["stage-resources", "stage-commits", "throughput", "stage-pairs"]
    assert blocks["docs/guide/gpu-check.md"] == ["gpu-check"]
    assert blocks["docs/architecture.md"] == ["stages"]
    assert set(render_docs.RENDERERS) == {b for bs in blocks.values() for b in bs}, "a renderer no page uses"


def _copy_for_rendering(tmp_path: Path) -> Path:
    """The pages and the data files the renderer reads, in a scratch checkout."""
    root = tmp_path / "repo"
    tree = committed_tree()
    for path in rendered_pages():
        (root / rel(path)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tree / rel(path), root / rel(path))
    for pattern in ("outputs/*/metrics.json", "outputs/*/config.json", "docs/compare_methods.tsv", "docs/frontier.md",
                    "docs/data/*.json", "dvc.yaml", "compare/dvc.yaml", "dvc.lock"):
        for path in tree.glob(pattern):
            (root / path.relative_to(tree)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, root / path.relative_to(tree))
    return root


def _run_renderer(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "render_docs.py"), "--root", str(root), *args],
                          capture_output=True, text=True)


def test_a_changed_data_value_fails_the_check_until_rendered(tmp_path):
    root = _copy_for_rendering(tmp_path)
    assert _run_renderer(root, "--check").returncode == 0
    path = root / "outputs/evaluate/metrics.json"
    metrics = json.loads(path.read_text())
    metrics["win_rate"]["ppo_vs_sft_gold"] = 0.5125
    path.write_text(json.dumps(metrics))
    proc = _run_renderer(root, "--check")
    assert proc.returncode == 1
    assert "README.md: headline" in proc.stderr
    assert "51.2%" not in (root / "README.md").read_text(), "--check must not write"
    assert _run_renderer(root).returncode == 0
    assert "**51.2%**" in (root / "README.md").read_text()
    assert _run_renderer(root, "--check").returncode == 0


def test_rendering_is_idempotent_and_a_null_metric_renders_as_na(tmp_path):
    root = _copy_for_rendering(tmp_path)
    path = root / "outputs/reward/metrics.json"
    metrics = json.loads(path.read_text())
    metrics["eval"]["accuracy_of_ceiling"] = None
    path.write_text(json.dumps(metrics))
    assert _run_renderer(root).returncode == 0
    once = {p: p.read_text() for p in render_docs.pages(root)}
    assert "(n/a of it)" in once[root / "README.md"]
    assert _run_renderer(root).returncode == 0
    assert {p: p.read_text() for p in render_docs.pages(root)} == once


def test_the_demo_block_renders_demo_json_and_says_so_when_there_is_none(tmp_path):
    root = _copy_for_rendering(tmp_path)
    (root / "docs/data/demo.json").unlink(missing_ok=True)
    text = render_docs.render_demo(root)
    assert "has not been measured on this commit" in text and "%" not in text
    (root / "docs/data").mkdir(parents=True, exist_ok=True)
    run = {"seed": 1, "seconds": 171.4, "win_rate_gold": 0.83, "win_rate_gold_low": 0.76, "win_rate_gold_high": 0.89,
           "sft_gold": 0.41, "ppo_gold": 2.02, "ppo_kl": 2.51, "rm_accuracy_of_ceiling": 0.884, "verdict": "OK"}
    demo = {"machine": "Test CPU, 4 cores, AVX2", "threads": 4, "date": "2030-01-02", "command": "make demo SEED=<seed>",
            "share_required": 0.7, "runs": [run, {**run, "seed": 0, "win_rate_gold": 0.65, "seconds": 180.0}]}
    (root / "docs/data/demo.json").write_text(json.dumps(demo))
    text = render_docs.render_demo(root)
    assert "Test CPU, 4 cores, AVX2, 4 threads, 2030-01-02" in text
    rows = [line for line in text.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert rows[0].startswith("| 0 | 180 s | 65.0% ") and rows[1].startswith("| 1 | 171 s | 83.0% (76.0-89.0%)")
    assert "held on 1 of 2 seeds" in text and "median wall time 2 min 56 s" in text
    assert _run_renderer(root, "--check").returncode == 1


def test_the_frontier_gap_is_rendered_where_the_data_has_it(tmp_path):
    """PPO's gold gap to the best-of-n frontier: in the headline, a column of the seeds table and of
    the compare run, from data that has it; data written before it was measured renders as before."""
    root = _copy_for_rendering(tmp_path)
    path = root / "outputs/evaluate/metrics.json"
    ev = json.loads(path.read_text())
    ev.pop("frontier", None)                                   # a run written before the gap was measured
    path.write_text(json.dumps(ev))
    compare_path = root / "outputs/compare/metrics.json"
    cm = json.loads(compare_path.read_text())
    cm.pop("frontier", None)
    compare_path.write_text(json.dumps(cm))
    grid_path = root / "docs/data/seed-grid.json"
    grid = json.loads(grid_path.read_text())
    for run in grid["runs"]:
        for key in [k for k in run if k.startswith(("ppo_gap_gold", "ppo_beyond", "ppo_margin"))]:
            del run[key]
    grid_path.write_text(json.dumps(grid))
    before = {name: render_docs.RENDERERS[name](root) for name in ("headline", "seeds", "compare-run")}
    assert "best-of-n frontier" not in before["headline"] and "gap to best-of-n" not in before["seeds"]
    assert "gap to best-of-n" not in before["compare-run"]
    path = root / "outputs/evaluate/metrics.json"
    ev = json.loads(path.read_text())
    ev["frontier"] = {"ppo_gap_gold": -0.4512, "ppo_gap_gold_low": -0.6049, "ppo_gap_gold_high": -0.2987,
                      "ppo_beyond_best_of_n": False}
    path.write_text(json.dumps(ev))
    sentence = ("Against the best-of-n frontier (the curve fitted through the best-of-n points) at its own "
                "KL, PPO's gold is -0.45 (95% CI -0.60 to -0.30; negative: below it).")
    assert sentence in render_docs.render_headline(root)
    ev["frontier"] = {"ppo_gap_gold": None, "ppo_gap_gold_low": None, "ppo_gap_gold_high": None,
                      "ppo_beyond_best_of_n": True, "ppo_margin_gold": -0.1221, "ppo_margin_gold_low": -0.2734,
                      "ppo_margin_gold_high": 0.0292}
    path.write_text(json.dumps(ev))
    assert ("PPO's KL to SFT is past best-of-n's largest, so its gap to the best-of-n frontier (the curve fitted "
            "through the best-of-n points) is not measured. Against the best gold that SFT or a best-of-n reaches "
            "at less KL, PPO's is -0.12 (95% CI -0.27 to +0.03; negative: a cheaper best-of-n does better)."
            ) in render_docs.render_headline(root)
    # The seeds table: a column once a run has the gap, "—" for a run recorded before it. The first
    # two recorded before the margin was, the third before the gap was, the fourth with both.
    grid["runs"][0].update(ppo_gap_gold=0.1234, ppo_gap_gold_low=0.0111, ppo_gap_gold_high=0.2345,
                           ppo_beyond_best_of_n=False)
    grid["runs"][1].update(ppo_gap_gold=None, ppo_gap_gold_low=None, ppo_gap_gold_high=None,
                           ppo_beyond_best_of_n=True)
    grid["runs"][3].update(ppo_gap_gold=None, ppo_gap_gold_low=None, ppo_gap_gold_high=None,
                           ppo_beyond_best_of_n=True, ppo_margin_gold=-0.1821, ppo_margin_gold_low=-0.3355,
                           ppo_margin_gold_high=0.3061)
    grid_path.write_text(json.dumps(grid))
    seeds = render_docs.render_seeds(root).splitlines()
    rows = [line.split(" | ") for line in seeds if line.startswith("| ")]
    col = rows[0].index("gold gap to best-of-n (95% CI)")
    assert [r[col] for r in rows[2:6]] == ["+0.12 (+0.01 to +0.23)", "beyond best-of-n", "—",
                                           "beyond; margin -0.18 (-0.34 to +0.31)"]
    assert render_docs.NO_INTERVAL not in render_docs.render_seeds(root)   # every gap shown has its interval
    grid["runs"][4].update(ppo_gap_gold=-0.0503, ppo_gap_gold_low=None, ppo_gap_gold_high=None,
                           ppo_beyond_best_of_n=False)
    grid_path.write_text(json.dumps(grid))
    seeds = render_docs.render_seeds(root)
    assert "| -0.05 |" in seeds and seeds.rstrip().endswith(render_docs.NO_INTERVAL)
    assert {len(r) for r in rows} == {len(rows[0])}
    # The compare run: a column for every policy, `-` for the baselines.
    cpath = root / "outputs/compare/metrics.json"
    cm = json.loads(cpath.read_text())
    cm["frontier"] = {"ppo_gap_gold": None, "ppo_gap_gold_low": None, "ppo_gap_gold_high": None,
                      "ppo_beyond_best_of_n": True, "dpo_gap_gold": -0.2, "dpo_gap_gold_low": -0.35,
                      "dpo_gap_gold_high": -0.05, "dpo_beyond_best_of_n": False}
    cpath.write_text(json.dumps(cm))
    run = render_docs.render_compare_run(root).splitlines()
    rows = {r[0][2:]: r for r in (line.split(" | ") for line in run if line.startswith("| "))}
    col = rows["policy"].index("gold gap to best-of-n (95% CI)")
    assert (rows["dpo"][col], rows["ppo"][col], rows["best-of-64"][col]) == ("-0.20 (-0.35 to -0.05)",
                                                                            "beyond best-of-n", "-")
    assert _run_renderer(root, "--check").returncode == 1 and _run_renderer(root).returncode == 0
    assert _run_renderer(root, "--check").returncode == 0


def test_the_headline_says_one_run_one_seed_its_machine_threads_and_date(tmp_path):
    text = render_docs.render_headline(REPO)
    assert "one seed" in text and "not a distribution" in text
    root = _copy_for_rendering(tmp_path)
    path = root / "outputs/evaluate/config.json"
    cfg = json.loads(path.read_text())
    cfg["runtime"] = {"device": "cpu", "processes": 1, "threads": 2}
    path.write_text(json.dumps(cfg))
    lock_md5 = render_docs.lock_md5(root, "outputs/evaluate/metrics.json")
    assert lock_md5 and len(lock_md5) == 32
    run = {"machine": "Test CPU, 4 cores, AVX2", "threads": 2, "date": "2030-01-02",
           "evaluate_metrics_md5": lock_md5}
    (root / "docs/data/committed-run.json").write_text(json.dumps(run))
    assert "measured on Test CPU, 4 cores, AVX2 (torch device cpu, 1 process) at 2 threads, 2030-01-02." \
        in render_docs.render_headline(root)
    cfg["runtime"] = {"device": "cpu", "processes": 1}
    path.write_text(json.dumps(cfg))
    text = render_docs.render_headline(root)
    assert "thread count the run's `config.json` does not record, 2030-01-02" in text
    # Without the file, the page says what it does not know.
    (root / "docs/data/committed-run.json").unlink()
    text = render_docs.render_headline(root)
    assert "measured on a machine that docs/data/committed-run.json does not name (torch device cpu" in text
    assert text.splitlines()[0].endswith(", undated.")


def test_the_committed_runs_machine_must_describe_this_run(tmp_path):
    """docs/data/committed-run.json names its run by dvc.lock's md5 of evaluate's metrics.json: after a
    new run (another md5), or at another thread count, rendering fails until the file is rewritten."""
    root = _copy_for_rendering(tmp_path)
    path = root / "docs/data/committed-run.json"
    run = json.loads(path.read_text())
    assert run["evaluate_metrics_md5"] == render_docs.lock_md5(root, "outputs/evaluate/metrics.json")
    path.write_text(json.dumps({**run, "evaluate_metrics_md5": "0" * 32}))
    proc = _run_renderer(root, "--check")
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"render_docs: error: docs/data/committed-run.json: evaluate_metrics_md5 is {'0' * 32}, "
        "but dvc.lock's outputs/evaluate/metrics.json is")
    assert "`make docs ARGS=--this-run` records this machine" in proc.stderr
    threads = json.loads((root / "outputs/evaluate/config.json").read_text())["runtime"]["threads"]
    path.write_text(json.dumps({**run, "threads": int(threads) + 1}))
    with pytest.raises(render_docs.RenderError,
                       match=f"threads is {int(threads) + 1}, but outputs/evaluate/config.json"):
        render_docs.render_headline(root)
    # --this-run: the run in outputs/ described as made here, then the pages render.
    proc = _run_renderer(root, "--this-run")
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, str(REPO / "benchmarks"))
    from demo_seeds import machine
    mtime = (root / "outputs/evaluate/metrics.json").stat().st_mtime
    assert json.loads(path.read_text()) == {
        "machine": machine(), "threads": threads, "evaluate_metrics_md5": run["evaluate_metrics_md5"],
        "date": datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).date().isoformat()}
    assert f"measured on {machine()} (" in render_docs.render_headline(root)


def test_the_readme_says_which_machine_each_table_ran_on(tmp_path):
    text = render_docs.render_headline(REPO)
    machines = [line for line in text.splitlines() if line.startswith("Machines: ")]
    assert len(machines) == 1
    for name in ("committed-run", "seed-grid", "demo"):
        assert json.loads((REPO / "docs/data" / f"{name}.json").read_text())["machine"] in machines[0]
    root = _copy_for_rendering(tmp_path)
    for name in ("seed-grid", "demo"):
        path = root / "docs/data" / f"{name}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "machine": "Test CPU, AVX2"}))
    run = {"machine": "Test CPU, AVX2"}
    assert render_docs.readme_machines(root, run) == \
        "Machines: the committed run, the seeds table and the demo table ran on Test CPU, AVX2."
    run = {"machine": "Other CPU, AVX-512"}
    sentence = render_docs.readme_machines(root, run)
    assert sentence.startswith("Machines: the committed run on Other CPU, AVX-512; the seeds table and "
                               "the demo table on Test CPU, AVX2. Another CPU")


def test_an_unknown_or_unclosed_block_is_an_error(tmp_path):
    with pytest.raises(render_docs.RenderError, match="unknown rendered block"):
        render_docs.render_text("<!-- rendered: nope -->\nx\n<!-- /rendered -->\n", REPO)
    with pytest.raises(render_docs.RenderError, match="not closed"):
        render_docs.render_text("<!-- rendered: demo -->\nx\n", REPO)


# ---- 2. measured numbers only in rendered blocks --------------------------------------------------


def test_no_measured_number_is_written_by_hand_in_readme_or_the_guides():
    pages = [p for p in rendered_pages() if p.name != "architecture.md"]   # it says how, never how well
    hits = {rel(p): render_docs.hand_written_numbers(p.read_text()) for p in pages}
    hits = {k: v for k, v in hits.items() if v}
    assert not hits, ("measured numbers outside rendered blocks (render them from data, or move them to a dated "
                      f"record in docs/decisions/): {hits}")


def test_the_number_heuristic_on_a_sample():
    sample = "\n".join([
        "PPO beats SFT on 92.5% of prompts.",                      # 1: flagged
        "The reward stage took 958.4 s, the PPO stage 4.1 min.",   # 2: flagged twice
        "1.78x faster, 0.55 GiB peak, 3.4 nats of KL.",            # 3: flagged three times
        "| ppo | 0.913 | quiet |",                                 # 4: flagged (a table row)
        "| ppo | 92% | quiet |",                                   # 5: flagged (a table row)
        "make pipeline: 25 min 26 s on a laptop.",                 # 6: flagged
        "gold 2.66 ± 0.13",                                        # 7: flagged (the interval)
        "torch 2.13.0, transformers 5.24.0, on 2026-12-02.",       # 8: versions and dates: not flagged
        "`ppo.kl_coef=0.05` and `sft.lr: 2e-3`, 30% of the pairs.",  # 9: code and an integer share: not flagged
        "Python 3.11 or 3.12; beta 0.1; every 5%.",                # 10: no unit: not flagged
        "<!-- rendered: headline -->",                             # 11
        "PPO beats SFT on 92.5% of prompts.",                      # 12: inside a rendered block: not flagged
        "<!-- /rendered -->",                                      # 13
        "```",                                                     # 14
        "total 70.8772 GiB",                                       # 15: fenced code: not flagged
        "```",                                                     # 16
        "![plot](docs/plot_0.95x.png)",                            # 17: a link target: not flagged
    ])
    hits = render_docs.hand_written_numbers(sample)
    assert sorted({line for line, _ in hits}) == [1, 2, 3, 4, 5, 6, 7]
    assert len([h for h in hits if h[0] == 2]) == 2 and len([h for h in hits if h[0] == 3]) == 3


# ---- 3. metric names and params keys exist --------------------------------------------------------

FENCE = render_docs.FENCE
SPAN = re.compile(r"`([^`]+)`")
# A metric name: lowercase segments joined by `/`, a glob `*` or a placeholder `{policy}` allowed.
METRIC_LIKE = re.compile(r"^[a-z_*{][a-z0-9_*{}]*(?:/[a-z0-9_*{}]+)+$")
# A params key: a top-level section, then `.key` segments; an assignment (`=0.1`, `: 0.1`) may follow.
PARAM_LIKE = re.compile(r"^([a-z_]+)((?:\.[a-z_][a-z0-9_]*)+)(?:\s*[=:].*)?$")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".tsv", ".png", ".sh", ".html", ".txt", ".csv",
                 ".lock", ".toml", ".rst", ".log", ".zip")


def code_spans(text: str) -> list[str]:
    """The inline code of a Markdown text (fenced blocks left out; a span may wrap a line)."""
    text = FENCE.sub("", text)
    return [" ".join(m.group(1).split()) for m in SPAN.finditer(text)]


def top_level_folders() -> set[str]:
    return {p.name for p in REPO.iterdir() if p.is_dir()} - {"data"}


def is_path(span: str) -> bool:
    """A file or folder of the repository, a run's output folder, or prepare's folder."""
    first = span.split("/", 1)[0]
    return first in top_level_folders() or span.startswith("data/prepared") or (REPO / span).exists()


@lru_cache(maxsize=1)
def metric_patterns() -> tuple[list[re.Pattern], list[str]]:
    """Regexes of every name a run can write or MLflow can show, and the concrete example names
    (placeholders filled in) that globs in the docs are matched against."""
    from pipeline.stages import metric_registry as registry
    from pipeline.tracking import metric_names as mn
    patterns, examples = [], []
    fills = {"policy": "ppo", "n": "64"}
    for m in registry.metrics():
        names = [m.name]
        if m.file.endswith(".tsv") and "/" not in m.name:
            names.append(f"{Path(m.file).stem}/{m.name}")            # MLflow's series name: train/loss
        if m.stage not in ("evaluate",):
            names += [f"{m.stage}/{n}" for n in list(names)]           # the parent run's headline: reward/eval/accuracy
        for name in names:
            patterns.append(mn.Metric(m.stage, m.file, name, m.meaning).regex())
            examples.append(re.sub(r"\{(\w+)\}", lambda g: fills.get(g.group(1), "x"), name))
    return patterns, examples


def unknown_metric(name: str) -> bool:
    patterns, examples = metric_patterns()
    if "*" in name:
        glob = re.compile("^" + re.escape(name).replace(r"\*", "[^/]+") + "$")
        return not any(glob.match(e) for e in examples)
    if "{" in name:
        from pipeline.stages import metric_registry as registry
        return not any(m.name == name for m in registry.metrics())
    return not any(p.fullmatch(name) for p in patterns)


def metric_mentions(text: str) -> list[str]:
    return sorted({s for s in code_spans(text) if METRIC_LIKE.match(s) and not is_path(s)})


def _field_type(cls: type, name: str) -> typing.Any:
    hints = typing.get_type_hints(cls)
    if name not in hints or name.startswith("_"):
        raise KeyError(name)
    kind = hints[name]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is typing.Union and len(args) == 1:
        kind = args[0]
    return kind


def params_key_exists(key: str) -> bool:
    """Whether `section.key...` names a field of the params schema (pipeline.config.Params)."""
    from pipeline.config import Params
    node: typing.Any = Params
    for part in key.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return False
        try:
            node = _field_type(node, part)
        except KeyError:
            return False
    return True


def params_mentions(text: str) -> list[str]:
    from pipeline.config import Params
    sections = {f.name for f in dataclasses.fields(Params)}
    keys = set()
    for span in code_spans(text):
        m = PARAM_LIKE.match(span)
        if not m or m.group(1) not in sections:
            continue
        key = m.group(1) + m.group(2)
        if key.endswith(FILE_SUFFIXES):
            continue
        keys.add(key)
    return sorted(keys)


def test_every_metric_name_the_pages_mention_is_in_the_registry():
    mentioned = {rel(p): metric_mentions(p.read_text()) for p in current_pages()}
    assert sum(map(len, mentioned.values())) > 20, "the pattern finds the metric names the pages mention"
    assert "val/logprob_diff_max" in mentioned["docs/guide/ppo.md"]
    unknown = {page: [n for n in names if unknown_metric(n)] for page, names in mentioned.items()}
    unknown = {k: v for k, v in unknown.items() if v}
    assert not unknown, f"metric names no stage declares (pipeline/stages/metric_registry.py): {unknown}"


def test_every_params_key_the_pages_mention_is_in_the_schema():
    mentioned = {rel(p): params_mentions(p.read_text()) for p in current_pages()}
    assert sum(map(len, mentioned.values())) > 50, "the pattern finds the params keys the pages mention"
    assert "distributed.zero_stage" in mentioned["docs/guide/scaling.md"]
    unknown = {page: [k for k in keys if not params_key_exists(k)] for page, keys in mentioned.items()}
    unknown = {k: v for k, v in unknown.items() if v}
    assert not unknown, f"params keys not in pipeline/config.py's Params: {unknown}"


def test_the_name_checks_on_a_sample():
    sample = ("Watch `win_rate/ppo_vs_sft_gold`, `eval/accuracy`, `val/logprob_diff_max`, `best_of_16/gold`, "
              "`reward/eval/accuracy_of_ceiling`, `train/loss`, `detector/*`, `*/rm`, "
              "`win_rate/{policy}_vs_sft_gold`, and `win_rate/ppo_vs_sft_golden`, `val/logprob_diff_median`, "
              "`nope/*`, with `outputs/ppo/model`, `data/prepared`, `docs/guide`. Set `ppo.kl_coef`, "
              "`distributed.zero_stage`, `ppo.sampling.temperature`, `ppo.distributed.offload_frozen`, "
              "`grpo.kl_loss_coef=0`, `data.n_audit_pairs: 20000`, `cluster.ppo.gpus`, and `ppo.kl_coeff`, "
              "`distributed.zero`, `ppo.sampling.temperature.x`, `sft.lr.value`; not `ppo.py`, `torch.profiler`.")
    names = metric_mentions(sample)
    assert "outputs/ppo/model" not in names and "data/prepared" not in names and "docs/guide" not in names
    assert [n for n in names if unknown_metric(n)] == ["nope/*", "val/logprob_diff_median", "win_rate/ppo_vs_sft_golden"]
    keys = params_mentions(sample)
    assert "ppo.py" not in keys and "torch.profiler" not in keys
    assert [k for k in keys if not params_key_exists(k)] == [
        "distributed.zero", "ppo.kl_coeff", "ppo.sampling.temperature.x", "sft.lr.value"]


# ---- 4. no issue-tracker references, no talk of sessions ------------------------------------------

ISSUE_WORD = re.compile(r"(?i)\bissues?\s*#?\d+\b")                 # the word, a number, with or without a hash
ISSUE_HASH = re.compile(r"(?<![\w&/#])#\d{1,4}\b")                  # a hash and a number (not an entity, a heading, a colour)
H = chr(35)   # the hash sign: the samples below are built with it, so that this file holds no reference
PROSE_SUFFIXES = (".md", ".py", ".yaml", ".yml", ".sh")
PROSE_NAMES = ("Makefile", "Snakefile")
# Assembled here so that this file does not hold them itself.
PHRASES = tuple(" ".join(p) for p in (("device", "tool"), ("no", "GPU", "was", "lent"), ("this", "session"),
                                      ("lent", "machine")))


def vendored(path: str) -> bool:
    return path.startswith("tests/data/") or (path.startswith(".dvc/plots/") and path.endswith(".html"))


def tracked_text_files() -> dict[str, str]:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    out = {}
    for path in filter(None, files.split("\0")):
        full = REPO / path
        if vendored(path) or not full.is_file():
            continue
        data = full.read_bytes()
        if b"\0" in data:
            continue
        try:
            out[path] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


def process_references(path: str, text: str) -> list[str]:
    """The issue-tracker references and session phrases of one file, as `path:line: text`."""
    hits = []
    prose = path.endswith(PROSE_SUFFIXES) or Path(path).name in PROSE_NAMES
    if path.endswith(".md"):    # code in Markdown may hold anything a shell or a colour does
        text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        text = re.sub(r"`[^`\n]*`", "``", text)
    for i, line in enumerate(text.splitlines(), 1):
        found = ISSUE_WORD.findall(line) + (ISSUE_HASH.findall(line) if prose else [])
        found += [p for p in PHRASES if p.lower() in line.lower()]
        hits += [f"{path}:{i}: {f!r}" for f in found]
    return hits


def test_no_tracked_file_refers_to_an_issue_tracker_or_a_session():
    files = tracked_text_files()
    assert "README.md" in files and "pipeline/config.py" in files
    hits = [h for path, text in files.items() for h in process_references(path, text)]
    assert not hits, "issue references or session talk in tracked files (say what is meant instead):\n" + "\n".join(hits)


def test_the_reference_check_on_a_sample():
    bad = [f"The goal of issue {H}16 is open.", "See issue" + " 21 for the GPU check.", f"fixed in {H}12",
           "As the " + PHRASES[0] + " says.", PHRASES[1].capitalize() + " here."]
    for line in bad:
        assert process_references("notes.md", line), line
    assert process_references("script.py", f"# see {H}7 for why")
    good = [f"{H}{H} Heading", f"color: {H}1f77b4;", f"&{H}39;quoted&{H}39;", f"a/{H}1", "rank 1 of 2",
            f"`grep '{H}12' log`", f"```\nexit {H}3\n```", "issued 3 warnings"]
    for line in good:
        assert not process_references("notes.md", line), line
    assert not process_references("data.csv", f"id,{H}12"), "the hash form is checked in prose files only"


# ---- 5. links resolve ------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's id of a heading: lowercase, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):     # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            out.append(f"{rel(page)}: {target} (no such file)")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{rel(page)}: {target} (no such heading)")
        elif REPO not in dest.parents and dest != REPO:
            out.append(f"{rel(page)}: {target} (outside the repository)")
    return out


def test_every_relative_link_resolves():
    broken = [b for page in all_doc_pages() for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_on_a_sample(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## The rollout policy's log-probs\n")
    page.write_text("[a](other.md) [b](other.md#the-rollout-policys-log-probs) [c](missing.md) [d](other.md#nope) "
                    "[e](https://example.com/x) ![f](img.png)\n")
    assert github_anchor("`make demo`") == "make-demo"
    assert github_anchor("The default over seeds (2026-12-02)") == "the-default-over-seeds-2026-12-02"
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        assert broken_links(page) == ["page.md: missing.md (no such file)", "page.md: other.md#nope (no such heading)",
                                      "page.md: img.png (no such file)"]
    finally:
        REPO = saved


# ---- the README and the docs map -------------------------------------------------------------------


def test_the_readme_is_a_product_page():
    text = README.read_text()
    assert len(text.splitlines()) < 250    # under 250 lines
    for command in ("make pipeline", "make test", "make demo"):
        assert f"\n{command}" in text, command
    outside = re.sub(r"<!-- rendered: [\w-]+ -->.*?<!-- /rendered -->", "", text, flags=re.S)
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", outside), "dated history belongs in docs/decisions/"


def test_the_readme_maps_every_guide_and_the_index_every_decision():
    readme = README.read_text()
    for page in sorted(GUIDE.glob("*.md")):
        assert f"(docs/guide/{page.name})" in readme, f"README's map of docs/ lacks {page.name}"
    for page in ("docs/architecture.md", "docs/metrics.md", "docs/decisions/README.md"):
        assert f"({page})" in readme, page
    index = (DECISIONS / "README.md").read_text()
    records = sorted(p.name for p in DECISIONS.glob("*.md") if p.name != "README.md")
    assert records, "docs/decisions/ holds the dated records"
    for name in records:
        assert re.match(r"^\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md$", name), f"{name}: YYYY-MM-DD-<what>.md"
        assert f"]({name})" in index, f"docs/decisions/README.md does not list {name}"
        assert (DECISIONS / name).read_text().startswith(f"# {name[:10]}"), f"{name}: its title starts with its date"
