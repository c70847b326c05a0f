"""DVC conventions of a finished run: the models as DVC artifacts a clone gets from the DVC remote,
the plots of dvc.yaml drawn by `dvc plots show` on a page that needs no network, and `make commit`
putting a run into git. The end-to-end tests share one tiny `dvc repro` in a temp git repository,
driven by the README's commands (make targets, `.venv/bin/dvc`) from a shell without the venv."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from conftest import BIN, REPO, TINY, bare_env, copy_run, load_script, run, write_params
from pipeline.stages import registry

ARTIFACTS = {"rlhf-policy": "outputs/ppo/model", "rlhf-sft-policy": "outputs/sft/model",
             "rlhf-reward-model": "outputs/reward/model"}
LIBRARIES = ("vega", "vega-lite", "vega-embed")
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]


def dvc_yaml() -> dict:
    return YAML(typ="safe", pure=True).load((REPO / "dvc.yaml").read_text())


def offline_page_module():
    return load_script(REPO / "scripts" / "dvc_offline_page.py")


def tree_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def make(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    # -o: never remake the venv marker; the repo's .venv is a link to the tests' own venv. The git
    # identity is for `make commit` and `make register` (GTO's annotated tags) on a machine without one.
    env = {**bare_env(repo), **{f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")
                                for what, value in (("NAME", "t"), ("EMAIL", "t@t"))}}
    return run(["make", "-s", "-o", ".venv/.installed", *args], repo, check=check, env=env)


def loads_from_network(page: str) -> list[str]:
    """Tags of the page that fetch from a network address (http, https or protocol-relative)."""
    return re.findall(r"<(?:script|link|img|iframe)[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//[^>]*>", page)


def porcelain(repo: Path) -> set[str]:
    """Paths git shows as changed or new, but the `.venv` link bare_env puts in (a link, so the
    `.venv/` pattern of .gitignore, which matches folders, does not hide it)."""
    lines = run(["git", "status", "--porcelain", "-uall"], repo).stdout.splitlines()
    return {line[3:] for line in lines} - {".venv"}


# ---- declarations (no run) -------------------------------------------------------------------------


def test_artifacts_are_the_three_cached_models():
    from dvc.exceptions import InvalidArgumentError
    from dvc.repo.artifacts import check_name_format

    spec = dvc_yaml()
    artifacts = spec["artifacts"]
    assert {name: a["path"] for name, a in artifacts.items()} == ARTIFACTS
    cached_outs = {next(iter(o)) if isinstance(o, dict) else o: o for stage in spec["stages"].values()
                   for o in stage.get("outs", [])}
    for name, a in artifacts.items():
        check_name_format(name)                  # DVC's (GTO's) rule; raises on a bad name
        out = cached_outs[a["path"]]
        assert isinstance(out, str), f"{a['path']} must be a DVC-cached out to be fetched from the remote"
        assert a["type"] == "model" and a["desc"].strip() and "rlhf" in a["labels"]
        assert a["meta"]["framework"] == "transformers" and a["meta"]["mlflow_registered_model"] == name
        assert registry.spec(a["meta"]["stage"]).model.registered == name   # the stage registers it so
        assert "from_pretrained" in a["meta"]["load"] or "load_reward_model" in a["meta"]["load"]
    with pytest.raises(InvalidArgumentError):
        check_name_format("rlhf policy")        # the check above can fail


def test_plots_are_drawn_from_the_stage_outputs_with_existing_templates():
    spec = dvc_yaml()
    outs = {next(iter(o)) if isinstance(o, dict) else o for stage in spec["stages"].values()
            for section in ("outs", "metrics", "plots") for o in stage.get(section, [])}
    plots = {name: p for entry in spec["plots"] for name, p in entry.items()}
    assert {"ppo_overoptimisation", "evaluate_policies", "reward_train_accuracy", "sft_loss"} <= set(plots)
    for name, p in plots.items():
        assert set(p["y"]) <= outs, f"plot {name} reads a file no stage writes"
        template = p["template"]
        assert template in ("linear", "simple", "scatter", "smooth") or \
            (REPO / ".dvc" / "plots" / f"{template}.json").is_file(), f"plot {name}: no template {template}"
    assert plots["evaluate_policies"]["x"] == "policy" and plots["evaluate_policies"]["template"] == "bars"
    assert plots["reward_train_accuracy"]["y"] == {"outputs/reward/train.tsv": "accuracy"}
    # Stage-level step logs carry no presentation of their own (it lives above): each would be drawn twice.
    assert not any(stage.get("plots") for stage in spec["stages"].values())


def test_offline_page_is_current_inlines_the_libraries_and_loads_nothing():
    page_path, notice_path = REPO / ".dvc" / "plots" / "offline.html", REPO / ".dvc" / "plots" / "NOTICE"
    page, notice = offline_page_module().render()
    assert page_path.read_text(encoding="utf-8") == page, "run .venv/bin/python scripts/dvc_offline_page.py"
    assert notice_path.read_text(encoding="utf-8") == notice
    # dvc_render fills {plot_divs}; without its scripts placeholder DVC's CDN tags have nowhere to go.
    assert "{plot_divs}" in page and "{scripts}" not in page
    assert len(re.findall(r"<script>", page)) == len(LIBRARIES)
    assert not loads_from_network(page)
    outside_scripts = re.sub(r"<script>.*?</script>", "", page, flags=re.S)
    assert not re.search(r"\b(src|href)\s*=", outside_scripts)
    assets = Path(importlib.util.find_spec("snakemake.assets").origin).parent / "data"
    for lib in LIBRARIES:
        code = (assets / lib / f"{lib}.js").read_text(encoding="utf-8")
        assert code in page
        licence = (assets / lib / "LICENSE").read_text(encoding="utf-8").strip()
        assert licence in notice and "Redistribution and use in source and binary forms" in licence
    # .dvc/config points `dvc plots show` at the page (a path relative to .dvc/).
    from dvc.config import Config

    assert Config(dvc_dir=str(REPO / ".dvc"), validate=True)["plots"]["html_template"] == "plots/offline.html"


# ---- a tiny finished run, committed and shared --------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_run) -> dict:
    """A user's story on tiny params: `dvc repro` (the shared run, copied), `make commit` (stage
    only), `make commit COMMIT=1`, `make register`, and `make commit` refused once params change.
    Returns the repo and what each step showed."""
    repo = copy_run(tiny_run, tmp_path_factory.mktemp("dvc_conventions") / "repo")
    story: dict = {"repo": repo, "changed": porcelain(repo)}
    story["stage_only"] = make(repo, "commit")
    story["staged"] = set(run(["git", "diff", "--cached", "--name-only"], repo).stdout.split())
    story["head_before"] = run(["git", "rev-parse", "HEAD"], repo).stdout.strip()
    story["commit"] = make(repo, "commit", "COMMIT=1")
    story["head_message"] = run(["git", "log", "-1", "--format=%s"], repo).stdout.strip()
    story["after"] = porcelain(repo)
    story["register"] = make(repo, "register")
    story["tags"] = set(run(["git", "tag"], repo).stdout.split())
    params = (repo / "params.yaml").read_text()
    write_params(repo / "params.yaml", {**TINY, "ppo": {**TINY["ppo"], "kl_coef": 0.123}})
    story["refused"] = make(repo, "commit", "COMMIT=1", check=False)
    (repo / "params.yaml").write_text(params)
    return story


def test_make_commit_stages_the_run_then_commits_it_when_asked(finished):
    repo = finished["repo"]
    # What git showed after the run: dvc.lock, the .gitignore files DVC writes for cached outs, and
    # the stages' small outputs; never a model file (those are DVC's).
    changed = finished["changed"]
    assert {"dvc.lock", "outputs/evaluate/policies.tsv", "outputs/ppo/metrics.json", "outputs/sft/.gitignore"} <= changed
    assert not any("/model/" in path or path.startswith("data/prepared/") for path in changed)
    # `make commit`: exactly those staged, nothing committed.
    assert finished["stage_only"].returncode == 0 and "git commit -m" in finished["stage_only"].stdout
    assert finished["staged"] == changed
    # COMMIT=1: one commit named for the run, and a clean tree after it.
    assert re.fullmatch(r"pipeline run \d{4}-\d{2}-\d{2}T\d{2}:\d{2}Z", finished["head_message"])
    assert finished["after"] == set()
    assert run(["git", "rev-list", "--count", f"{finished['head_before']}..HEAD"], repo).stdout.strip() == "1"
    # A workspace that is not the locked run is refused, and the message says why.
    refused = finished["refused"]
    assert refused.returncode != 0 and "not the run in dvc.lock" in refused.stderr
    assert run(["git", "log", "-1", "--format=%s"], repo).stdout.strip() == finished["head_message"]


def test_make_register_tags_a_version_of_each_model(finished):
    # GTO's annotated tags, what `dvc artifacts get` resolves a name (and version) with.
    assert finished["tags"] == {f"{name}@v0.0.1" for name in ARTIFACTS}
    repo = finished["repo"]
    for name in ARTIFACTS:
        kind = run(["git", "cat-file", "-t", f"{name}@v0.0.1"], repo).stdout.strip()
        target = run(["git", "rev-list", "-n1", f"{name}@v0.0.1"], repo).stdout.strip()
        assert kind == "tag" and target == run(["git", "rev-parse", "HEAD"], repo).stdout.strip()


def test_plots_show_writes_a_page_that_needs_no_network(finished, tmp_path):
    repo = finished["repo"]
    proc = run([str(BIN / "dvc"), "plots", "show", "-o", str(tmp_path / "plots")], repo, env=bare_env(repo))
    page = (tmp_path / "plots" / "index.html").read_text(encoding="utf-8")
    assert "index.html" in proc.stdout
    assert not loads_from_network(page) and "cdn.jsdelivr" not in page
    for lib in LIBRARIES:
        assert f"/* {lib} " in page                  # each library inline, from the offline page
    names = [name for entry in dvc_yaml()["plots"] for name in entry]
    for name in names:
        assert f'<div id = "{name}">' in page
    # The bar plot's data: one row per policy and score, the policies by name, in report order.
    divs = dict(re.findall(r'<div id = "([^"]+)">\s*<script type = "text/javascript">\s*var spec = (.*?);\s*vegaEmbed',
                           page, re.S))
    rows = json.loads(divs["evaluate_policies"])["data"]["values"]
    policies = ["sft", *(f"best_of_{n}" for n in TINY["evaluate"]["best_of_n"]), "ppo"]
    assert [r["policy"] for r in rows if r["field"] == "gold"] == policies
    assert sorted({r["field"] for r in rows}) == ["gold", "rm"]


NODE_RENDER = r"""
// Run the page's inline scripts in a sandbox (no DOM, no network), catch each plot's
// vegaEmbed(spec), compile it with the inlined vega-lite and draw it with the inlined vega as SVG.
const fs = require('fs'), vm = require('vm');
const html = fs.readFileSync(process.argv[2], 'utf8');
const ctx = {console, setTimeout, clearTimeout, Promise};
ctx.globalThis = ctx.self = ctx.window = ctx;
ctx.addEventListener = ctx.removeEventListener = () => {};   // vega binds window events (zoom/pan)
vm.createContext(ctx);
const specs = [];
let embed = null;
for (const [, code] of html.matchAll(/<script[^>]*>([\s\S]*?)<\/script>/g)) {
  if (code.includes('vegaEmbed(')) {
    embed = embed || ctx.vegaEmbed;
    ctx.vegaEmbed = (el, spec) => specs.push([el, spec]);
  }
  vm.runInContext(code, ctx);
}
(async () => {
  const out = {embed: typeof embed, versions: [ctx.vega.version, ctx.vegaLite.version, embed && embed.version], plots: {}};
  for (const [el, spec] of specs) {
    const view = new ctx.vega.View(ctx.vega.parse(ctx.vegaLite.compile(spec).spec), {renderer: 'none'});
    const svg = await view.toSVG();
    const rects = svg.match(/<g class="mark-rect role-mark[^>]*>([\s\S]*?)<\/g>/);
    out.plots[el.slice(1)] = {bars: rects ? (rects[1].match(/<path/g) || []).length : 0,
                              lines: (svg.match(/class="mark-line role-mark/g) || []).length};
  }
  console.log(JSON.stringify(out));
})().catch(e => { console.error(e.stack || e); process.exit(3); });
"""


def test_plots_render_with_the_inlined_libraries_alone(finished, tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the page's scripts cannot be run outside a browser")
    repo = finished["repo"]
    run([str(BIN / "dvc"), "plots", "show", "-o", str(tmp_path / "plots")], repo, env=bare_env(repo))
    (tmp_path / "render.js").write_text(NODE_RENDER)
    out = json.loads(run([node, str(tmp_path / "render.js"), str(tmp_path / "plots" / "index.html")], tmp_path).stdout)
    assert out["embed"] == "function"            # vega-embed, inline, defined what the divs call
    assert out["versions"][0].startswith("5.") and out["versions"][1].startswith("5.")
    names = [name for entry in dvc_yaml()["plots"] for name in entry]
    assert sorted(out["plots"]) == sorted(names)
    n_policies = 2 + len(TINY["evaluate"]["best_of_n"])
    assert out["plots"]["evaluate_policies"]["bars"] == 2 * n_policies      # RM and gold per policy
    assert out["plots"]["evaluate_kl"]["bars"] == n_policies
    assert out["plots"]["reward_train_accuracy"]["lines"] == 2              # the raw line and its loess
    assert out["plots"]["ppo_overoptimisation"]["lines"] >= 1 and out["plots"]["sft_loss"]["lines"] >= 1


def test_a_clone_gets_the_policy_from_the_dvc_remote(finished, tmp_path):
    repo = finished["repo"]
    # `make push` with the committed default remote: a folder beside the checkout.
    make(repo, "push")
    storage = repo.parent / "rlhf-dvc-storage"
    assert any(p.is_file() for p in (storage / "files" / "md5").rglob("*"))
    original = tree_hashes(repo / ARTIFACTS["rlhf-policy"])
    assert "model.safetensors" in original and "tokenizer.json" in original

    # A clone elsewhere: its default remote (beside it) is empty, so nothing comes without configuring it.
    clone = tmp_path / "elsewhere" / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    failed = run([str(BIN / "dvc"), "artifacts", "get", ".", "rlhf-policy", "-o", "policy"], clone,
                 check=False, env=bare_env(clone))
    assert failed.returncode != 0 and not (clone / "policy").exists()

    make(clone, "remote", f"REMOTE={storage}")
    assert "rlhf-dvc-storage" in (clone / ".dvc" / "config.local").read_text()
    run([str(BIN / "dvc"), "artifacts", "get", ".", "rlhf-policy", "-o", "policy"], clone, env=bare_env(clone))
    assert tree_hashes(clone / "policy") == original
    # And the whole run: `dvc pull dvc.yaml` restores every cached output, so DVC finds nothing to
    # re-run. (A bare `dvc pull` also wants compare/dvc.yaml's models, which this run never built.)
    run([str(BIN / "dvc"), "pull", "dvc.yaml"], clone, env=bare_env(clone))
    assert tree_hashes(clone / ARTIFACTS["rlhf-reward-model"]) == tree_hashes(repo / ARTIFACTS["rlhf-reward-model"])
    status = run([str(BIN / "dvc"), "status", "dvc.yaml"], clone, env=bare_env(clone)).stdout
    assert "up to date" in status


def test_every_stage_says_what_it_does():
    """`desc:` on every stage of both pipelines, as DVC reads it (`dvc stage list` shows it)."""
    from dvc.repo import Repo
    stages = Repo(str(REPO)).index.stages
    assert {s.addressing for s in stages} >= {"prepare", "sft", "reward", "ppo", "evaluate", "compare/dvc.yaml:compare"}
    assert [s.addressing for s in stages if len((s.desc or "").split()) < 6] == []
