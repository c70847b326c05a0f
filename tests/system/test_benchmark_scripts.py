"""The benchmark scripts run against today's code: a benchmark that rots is found by the tests, not
by the next person who needs its number (ppo_vs_trl.py's set-up called a removed signature of
sft.train for two days). TRL itself is an optional install (`make bench`), so only our side runs."""

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import load_script
from pipeline.stages import registry

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    return load_script(ROOT / "benchmarks" / f"{name}.py")


def test_ppo_vs_trl_builds_the_shared_models_and_times_our_trainer(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIPELINE_TRACKING", "off")
    bench = load("ppo_vs_trl")
    bench.build(tmp_path, sft_epochs=0.1)
    for name in ("policy", "reward"):
        assert (tmp_path / name / "model.safetensors").is_file()
    # The policy is the SFT stage's model, saved again: same config, and the reward model shares its trunk size.
    policy = json.loads((tmp_path / "policy" / "config.json").read_text())
    reward = json.loads((tmp_path / "reward" / "config.json").read_text())
    assert policy["hidden_size"] == reward["hidden_size"] == 96 and len(reward["id2label"]) == 1
    assert reward["architectures"] == ["LlamaForSequenceClassification"]
    assert len(bench.prompts(tmp_path)) == 1024
    result = bench.run_ours(tmp_path, updates=1)
    assert set(result) == {"episodes_per_s", "tokens_per_s", "seconds", "peak_rss_mb"}
    assert result["seconds"] > 0 and math.isclose(result["episodes_per_s"], bench.BATCH / result["seconds"])
    assert 0 < result["tokens_per_s"] <= bench.RESPONSE * result["episodes_per_s"]

    # The reward-model step benchmarks, on the same SFT model and the (eight) prepared pairs.
    for name, ways in (("rm_step", ("tokenised afresh", "ids kept")),
                       ("rm_shared_prompt", ("two rows per pair", "shared prompt"))):
        monkeypatch.setattr("sys.argv", [name, "--steps", "2", "--data", str(tmp_path / "data"),
                                         "--sft", str(tmp_path / "sft" / "model")])
        load(name).main()
        out = capsys.readouterr().out
        for way in ways:
            ms = float(out.split(f"{way}:", 1)[1].split("ms/step", 1)[0].split()[-1])
            assert ms > 0, (name, way, out)
        if name == "rm_step":                                  # the set-up line: both ways timed, same rows
            setup = out.split("set-up, ", 1)[1].splitlines()[0]
            assert setup.startswith("8 pairs") and setup.endswith("lengths and rows equal"), out
            assert float(setup.split("once:", 1)[1].split(" ms", 1)[0]) >= 0, out
            assert float(setup.split("(", 1)[1].split("x)", 1)[0]) > 0, out
        ratio = out.strip().splitlines()[-1]                     # "ratio ...: 1.14x ..."
        assert ratio.startswith("ratio") and float(ratio.split(": ", 1)[1].split("x", 1)[0]) > 0, out

    # Our sampler's rollout options on the same SFT model and the prepared prompts: four ways timed,
    # dropping ended rows changes no response of its own stream, a quarter of the rows a quarter of the KV cache.
    load("rollout_speed").main(["--sft", str(tmp_path / "sft" / "model"), "--data", str(tmp_path / "data"),
                                "--batch", "16", "--max-new-tokens", "24", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "16 prompts, up to 24 new tokens" in out and out.splitlines()[0].endswith("with row streams: True"), out
    rows = re.findall(r"^  (\S.*?)\s+([\d.]+) s\s+(\d+) tokens\s+([\d.]+)x  KV cache at its longest\s+([\d.]+) MiB$",
                      out, flags=re.M)
    assert [r[0] for r in rows] == ["default", "drop finished", "micro-batch 4", "micro-batch 4 + drop"], out
    assert all(float(r[1]) > 0 and 0 < int(r[2]) <= 16 * 24 for r in rows), out
    kv = [float(r[4]) for r in rows]
    assert kv[0] == kv[1] == pytest.approx(4 * kv[2], rel=0.01) and kv[2] == kv[3], out
    assert out.strip().splitlines()[-1].startswith("RATIO rollout default/drop-finished: "), out


def test_throughput_benchmark_times_both_batchings_of_every_stage(tmp_path):
    """benchmarks/throughput.py at a toy shape: every stage timed both ways, its numbers consistent
    with each other (the speed-up is the ratio of the medians; the budget's sorted micro-batches
    carry less padding than fixed rows on lengths that vary 10x; PPO's update trains the actor and
    the critic), the sampler timed beside them, written where asked."""
    out = tmp_path / "throughput.json"
    assert load("throughput").main(["--hidden", "32", "--layers", "1", "--heads", "2", "--vocab", "256",
                                    "--batch", "8", "--rows", "2", "--steps", "2", "--new-tokens", "16",
                                    "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["stage"] for r in result["stages"]] == ["sft", "reward", "dpo", "ppo"]
    n = result["model"]["non_embedding_params"]
    assert result["peak_flops"] > 0 and n > 0
    for row in result["stages"]:
        fixed, budget = row["rows"], row["tokens"]
        assert row["speedup"] == pytest.approx(fixed["seconds_per_batch"] / budget["seconds_per_batch"])
        assert 0 <= budget["pad_share"] < fixed["pad_share"] < 1, row
        # The critic is the actor's trunk with a scalar head in place of the vocabulary's.
        per_token = 6 * (2 * n - 256 * 32 + 32) if row["stage"] == "ppo" else 6 * n
        assert row["flops_per_token"] == per_token, row
        for way in (fixed, budget):
            assert way["tokens_per_second"] > 0
            assert way["mfu"] == pytest.approx(per_token * way["tokens_per_second"] / result["peak_flops"])
    sampler = result["sampler"]
    assert sampler["prompts"] == 8 and sampler["new_tokens"] == 16 and sampler["seconds_per_call"] > 0
    # at most every prompt's 16 new tokens a call, at least one each
    assert 8 / sampler["seconds_per_call"] <= sampler["tokens_per_second"] <= 8 * 16 / sampler["seconds_per_call"]


@pytest.mark.long
def test_stages_benchmark_runs_both_sides_and_compares_their_models(tmp_path):
    """benchmarks/stages.py --base HEAD on the tiny params: every stage of both sides ran, the ratio
    is each side's time, and the models of the working tree and HEAD are compared by md5 (a fresh
    clone's tree is HEAD: identical models)."""
    import subprocess
    import sys

    from conftest import TINY, run_env, write_params
    write_params(tmp_path / "tiny.yaml", TINY)
    out = tmp_path / "stages.tsv"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "pipeline", "dvc.yaml"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/stages.py"), "--base", "HEAD", "--params",
                           str(tmp_path / "tiny.yaml"), "--out", str(out), "--json", str(tmp_path / "stages.json")],
                          cwd=ROOT, env=run_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, *rows = [line.split("\t") for line in out.read_text().splitlines()]
    table = [dict(zip(header, r)) for r in rows]
    assert [r["stage"] for r in table] == ["prepare", "sft", "reward", "ppo", "evaluate"]
    for r in table:
        assert float(r["ratio"]) == pytest.approx(float(r["head_s"]) / float(r["base_s"]), rel=0.02)
        assert (r["head_md5"] == "-") == (r["stage"] in ("prepare", "evaluate"))
        if not dirty:   # HEAD against itself
            assert r["same_model"] == "True" and r["head_md5"] == r["base_md5"], r
    assert "head/base" in proc.stdout
    data = json.loads((tmp_path / "stages.json").read_text())
    assert [r["stage"] for r in data["rows"]] == [r["stage"] for r in table] and data["machine"]
    assert data["total"]["head"] == pytest.approx(sum(float(r["head_s"]) for r in table), abs=0.01)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert data["sides"]["base"] == "HEAD" and data["sides"]["head"].startswith(head), data["sides"]   # the commits timed
    assert data["sides"]["head"].endswith(f"with {tmp_path / 'tiny.yaml'}")
    both = subprocess.run([sys.executable, str(ROOT / "benchmarks/stages.py"), "--base", "HEAD", "--vs-params",
                           str(tmp_path / "tiny.yaml")], cwd=ROOT, capture_output=True, text=True)
    assert both.returncode == 2 and "one comparison at a time" in both.stderr


# --- The scripts that need trained models or whole stages (minutes even at their smallest) run here on
# what is cheap and still theirs: their own functions on small inputs, their `main` with the stage
# commands or the model answered by stand-ins built from the committed run's metrics (outputs/*/
# metrics.json, tracked by git, written by today's stages), so the keys they read are the real ones.
# Every stage command such a `main` builds is parsed by the pipeline's own command line and its
# params file loaded, so a renamed flag or params key fails here rather than an hour into a sweep.

OUTPUTS = ROOT / "outputs"


def committed(stage: str) -> dict:
    """The committed run's metrics.json of a stage."""
    return json.loads((OUTPUTS / stage / "metrics.json").read_text())


@pytest.fixture
def own_sys_path(monkeypatch):
    """The scripts put the repository and benchmarks/ at the front of sys.path as they load (a script
    run from a shell has its folder there): kept to the test that loads them."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:   # what they imported from benchmarks/ (seed_grid, demo_seeds)
        if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(ROOT / "benchmarks")):
            del sys.modules[name]


def parsed_stage(cmd: list[str], cwd: Path):
    """The arguments `python -m pipeline <cmd>` would run with, after the checks a real stage makes
    before any compute: the command line parses, its params file loads, and every model or data folder
    it names exists (a stage that ran earlier wrote it)."""
    from pipeline.__main__ import _parser
    from pipeline.config import load_params
    try:
        args = _parser().parse_args([*cmd, "--no-progress"])
    except SystemExit:
        pytest.fail(f"python -m pipeline refuses {cmd}")
    args.loaded = load_params(cwd / args.params)
    for name in ("data", "sft", "reward", "ppo"):
        if name in vars(args):
            assert (cwd / getattr(args, name)).is_dir(), (cmd, name, "names no folder a stage wrote")
    for policy in getattr(args, "policy", []):
        assert (cwd / policy.split("=", 1)[1]).is_dir(), (cmd, policy)
    return args


def test_gae_benchmark_loop_is_gae_and_main_reports_its_ratios(own_sys_path, monkeypatch, capsys):
    """benchmarks/gae.py: its per-sample loop (the reference every timing is against) computes GAE:
    by hand on one row, and equal to the pipeline's on ragged rows. `main` also times 512 x 1024, where
    the Python loop alone takes about half a minute at one thread: it runs here with the vectorised
    function standing in for the loop, which still checks its calls of today's gae, its agreement
    check and its report."""
    import torch
    bench = load("gae")
    from pipeline.ppo.advantages import gae

    # One full row, gamma 0.9, lam 0.5, by hand: A2 = 2 - 1 = 1; A1 = 0 + 0.9 * 1 - 0.25 + 0.45 * 1 = 1.1;
    # A0 = 1 + 0.9 * 0.25 - 0.5 + 0.45 * 1.1 = 1.22.
    r, v = torch.tensor([[1.0, 0.0, 2.0]], dtype=torch.float64), torch.tensor([[0.5, 0.25, 1.0]], dtype=torch.float64)
    loop = bench.per_sample_loop(r, v, torch.ones(1, 3, dtype=torch.bool), 0.9, 0.5)
    assert torch.allclose(loop, torch.tensor([[1.22, 1.1, 1.0]], dtype=torch.float64))
    # Ragged rows: the state after a row's last real token is terminal, pads stay zero.
    torch.manual_seed(0)
    rewards, values = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 1, 4, 6, 2])[:, None]
    loop = bench.per_sample_loop(rewards, values, mask, 1.0, 0.95)
    assert torch.allclose(loop, gae(rewards, values, mask, 1.0, 0.95)[0])
    assert loop[~mask].abs().max() == 0 and loop[1, 0] == rewards[1, 0] - values[1, 0]

    calls = []
    assert bench.best_of(lambda: calls.append(1), 3) >= 0 and len(calls) == 3

    monkeypatch.setattr(bench, "per_sample_loop", lambda *a: gae(*a)[0])
    assert bench.main() == 0
    out = capsys.readouterr().out
    ratios = [float(x) for x in re.findall(r"RATIO loop/ours +([\d.]+)x", out)]
    assert re.findall(r"B= *(\d+) R= *(\d+):", out) == [("64", "256"), ("512", "1024")], out
    assert len(ratios) == 2 and all(x > 0 for x in ratios), out
    assert out.strip().splitlines()[-1] == f"RATIO GAE loop/ours: min {min(ratios):.1f}x", out
    # Its check that both ways agree stops the timing when they do not.
    monkeypatch.setattr(bench, "per_sample_loop", lambda *a: gae(*a)[0] + 1e-3)
    with pytest.raises(AssertionError, match="disagree"):
        bench.main()


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory) -> Path:
    """An untrained tiny reward model on the task's word tokenizer: what the reward-model benchmarks
    load and score with, without the minutes of training that only change the numbers."""
    from conftest import tiny_policy_and_reward_model
    from pipeline.data.tokenizer import build_word_tokenizer
    from pipeline.tasks import reviews
    root = tmp_path_factory.mktemp("rm")
    build_word_tokenizer(reviews.vocabulary()).save_pretrained(str(root / "data" / "tokenizer"))
    return tiny_policy_and_reward_model(root, root / "data")[1]


def gold_scorer(sign: float):
    """A stand-in for reward_model.score_texts that scores with the annotator's gold score (times
    `sign`; 0 for a model that ties everything): the answers the benchmarks' arithmetic must turn
    into their extremes."""
    import torch
    from pipeline.tasks import reviews

    def score_texts(model, tok, prompts, responses, max_length, batch_size=64):
        assert model == "gold" and tok == "gold"
        return torch.tensor([sign * reviews.gold_score(p, r) for p, r in zip(prompts, responses)])
    return score_texts


def test_rm_expected_accuracy_benchmark_scores_a_model_against_the_ceiling(tiny_rm, own_sys_path, monkeypatch,
                                                                           capsys):
    """benchmarks/rm_expected_accuracy.py on 100 fresh pairs (5000 in the benchmark): a real reward
    model lies between the floor and the ceiling; a model ranking by gold reaches the ceiling exactly,
    one ranking against it the floor (1 - ceiling), one tying everything 0.5."""
    import torch
    bench = load("rm_expected_accuracy")
    monkeypatch.setattr(bench, "N_PAIRS", 100)
    from pipeline.config import load_params
    data = load_params(ROOT / "params.yaml").data    # what main reads its sampler's settings from
    prompts, chosen, rejected, p = bench.fresh_pairs(data.seed, data.eval_title_fraction, data.label_temperature)
    assert len(prompts) == len(chosen) == len(rejected) == p.numel() == 100
    assert ((p > 0) & (p < 1)).all() and float(p.mean()) > 0.5   # the labels follow the annotator more often than not
    ceiling = float(torch.maximum(p, 1 - p).mean())

    line = re.compile(r"^(.+): expected accuracy ([\d.]+) / ceiling ([\d.]+) = ([\d.]+)% of the ceiling$")
    bench.main([str(tiny_rm)])
    (found,) = [line.match(x) for x in capsys.readouterr().out.splitlines()]
    assert found and found[1] == str(tiny_rm), found
    expected, shown_ceiling = float(found[2]), float(found[3])
    assert 0.5 < shown_ceiling <= 1 and 1 - shown_ceiling - 1e-4 <= expected <= shown_ceiling + 1e-4
    assert float(found[4]) == pytest.approx(100 * expected / shown_ceiling, abs=0.06)

    monkeypatch.setattr(bench.rm, "load_reward_model", lambda d: ("gold", "gold"))
    for sign, want in ((1.0, f"{ceiling:.4f}"), (-1.0, f"{1 - ceiling:.4f}"), (0.0, "0.5000")):
        monkeypatch.setattr(bench.rm, "score_texts", gold_scorer(sign))
        bench.main(["oracle"])
        got = line.match(capsys.readouterr().out.strip())
        assert got and (got[2], got[3]) == (want, f"{ceiling:.4f}"), (sign, got)
    assert got[4] == f"{100 * 0.5 / ceiling:.1f}"


def test_rm_faults_benchmark_prints_how_often_a_model_prefers_the_intact_review(tiny_rm, own_sys_path,
                                                                              monkeypatch, capsys):
    """benchmarks/rm_faults.py's `main` on 100 reviews (1000 in the benchmark): a column per fault
    kind, `aspect` and `exchange`, with the pair counts of fault_pairs; a real model's fraction in [0, 1]; the
    gold annotator as the model sees every fault (1.00, positive gap), its negative none (0.00), a
    model tying everything is blind (0.50, gap 0)."""
    from pipeline.tasks import reviews
    bench = load("rm_faults")
    monkeypatch.setattr(bench, "N_REVIEWS", 100)
    from pipeline.config import load_params
    data = load_params(ROOT / "params.yaml").data
    counts = {k: len(v[0]) for k, v in bench.fault_pairs(data.seed, data.eval_title_fraction).items()}
    assert list(counts) == [*reviews.CORRUPTIONS, "aspect", "exchange"] and all(n > 0 for n in counts.values()), counts
    cell = re.compile(r"(\w+) ([\d.]+) \(gap ([+-][\d.]+), n=(\d+)\)")

    def columns(out: str, model: str) -> dict[str, tuple[float, float, int]]:
        head, _, cells = out.strip().partition(": prefers the intact review: ")
        assert head == model, out
        parsed = [cell.fullmatch(c) for c in cells.split("; ")]
        assert all(parsed), out
        return {m[1]: (float(m[2]), float(m[3]), int(m[4])) for m in parsed}

    bench.main([str(tiny_rm)])
    real = columns(capsys.readouterr().out, str(tiny_rm))
    assert {k: n for k, (_, _, n) in real.items()} == counts
    assert all(0 <= sees <= 1 for sees, _, _ in real.values()), real

    monkeypatch.setattr(bench.rm, "load_reward_model", lambda d: ("gold", "gold"))
    for sign, sees in ((1.0, 1.0), (-1.0, 0.0), (0.0, 0.5)):
        monkeypatch.setattr(bench.rm, "score_texts", gold_scorer(sign))
        bench.main(["oracle"])
        got = columns(capsys.readouterr().out, "oracle")
        assert {k: s for k, (s, _, _) in got.items()} == dict.fromkeys(counts, sees), (sign, got)
        assert all((gap > 0) if sign > 0 else (gap < 0) if sign < 0 else gap == 0 for _, gap, _ in got.values())


def test_demo_seeds_collects_each_seeds_demo_and_holds_the_guarantee(tmp_path, own_sys_path, monkeypatch, capsys):
    """benchmarks/demo_seeds.py around scripts/demo.py (minutes a seed): each seed's demo is
    answered by the summary demo.py itself writes, of the committed run's metrics, with the gold win
    rate set per seed. What is checked is the collector's: the command per seed, the file it writes
    (machine, threads, runs by seed), the medians it prints, exit 1 below --share, --replace keeping
    the other seeds, refusing another machine's file, and a failed demo."""
    bench = load("demo_seeds")
    demo = load_script(ROOT / "scripts" / "demo.py")
    root = tmp_path / "checkout"
    monkeypatch.setattr(bench, "ROOT", root)
    run_dir = tmp_path / "committed_run"
    for stage in ("evaluate", "reward"):
        (run_dir / "outputs" / stage).mkdir(parents=True)
        shutil.copy(OUTPUTS / stage / "metrics.json", run_dir / "outputs" / stage / "metrics.json")
    win = {0: 0.8, 1: 0.75, 2: 0.9}
    ran, fail = [], {}

    def fake_run(cmd, cwd):
        seed = int(cmd[-1])
        assert cmd == [sys.executable, str(root / "scripts" / "demo.py"), "--seed", str(seed)] and cwd == root
        ran.append(seed)
        if seed in fail:
            return subprocess.CompletedProcess(cmd, fail[seed])
        summary = {**demo.summary(run_dir, seed, 100.0 + seed), "win_rate_gold": win[seed]}
        (root / ".demo" / f"seed-{seed}").mkdir(parents=True, exist_ok=True)
        (root / ".demo" / f"seed-{seed}" / "demo.json").write_text(json.dumps(summary))
        return subprocess.CompletedProcess(cmd, 0)
    # Its own `subprocess` only: the global one serves others (platform asks `uname -p` through it).
    monkeypatch.setattr(bench, "subprocess", types.SimpleNamespace(run=fake_run))

    out = tmp_path / "demo.json"
    assert bench.main(["--seeds", "2", "0", "1", "--out", str(out)]) == 0
    assert ran == [2, 0, 1]
    result = json.loads(out.read_text())
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count())
    assert (result["machine"], result["threads"], result["share_required"]) == (bench.machine(), threads, 0.70)
    assert f"{os.cpu_count()} cores" in result["machine"]
    assert [r["seed"] for r in result["runs"]] == [0, 1, 2]
    assert [r["win_rate_gold"] for r in result["runs"]] == [0.8, 0.75, 0.9]
    ev = committed("evaluate")
    assert all(r["ppo_gold"] == ev["ppo"]["gold"] and r["win_rate_gold_low"] == ev["win_rate"]["ppo_vs_sft_gold_low"]
               for r in result["runs"])
    assert "gold win rate median 80.0% (range 75.0%-90.0%); time median 101 s (range 100-102)" in \
        capsys.readouterr().out

    # Seed 1 measured again, now below the guarantee: the others kept, exit 1 naming it.
    win[1], ran[:] = 0.6, []
    assert bench.main(["--seeds", "1", "--replace", "--out", str(out)]) == 1
    assert ran == [1]
    assert [(r["seed"], r["win_rate_gold"], r["seconds"]) for r in json.loads(out.read_text())["runs"]] == \
        [(0, 0.8, 100.0), (1, 0.6, 101.0), (2, 0.9, 102.0)]
    assert "below the 70% guarantee on seed(s) [1]" in capsys.readouterr().err

    # Another machine's file is not mixed with this one's.
    other = {**json.loads(out.read_text()), "machine": "another CPU"}
    out.write_text(json.dumps(other))
    ran[:] = []
    assert bench.main(["--seeds", "1", "--replace", "--out", str(out)]) == 1
    assert ran == [] and json.loads(out.read_text()) == other
    assert "was measured on another CPU" in capsys.readouterr().err

    fail[0] = 3
    assert bench.main(["--seeds", "0", "--out", str(tmp_path / "failed.json")]) == 1
    assert "seed 0 failed (exit 3)" in capsys.readouterr().err and not (tmp_path / "failed.json").exists()


def fake_stages(calls: list, seconds: dict[str, float]):
    """A stand-in for the benchmarks' `stage(cmd, cwd, threads, log)`: checks the command as the
    pipeline would (parsed_stage), records (stage, threads), and writes what that stage writes in its
    --out: a model folder, and the committed run's metrics and step log for the stages whose outputs
    the benchmarks read. The compare stage's metrics hold, per --policy NAME, the committed entry of
    the method NAME starts with, its gold moved by the run's seed (so rows can be told apart)."""
    def stage(cmd, cwd, threads, log):
        args = parsed_stage(cmd, cwd)
        calls.append((cmd[0], threads))
        out = cwd / args.out
        out.mkdir(parents=True, exist_ok=True)
        if cmd[0] in registry.training():   # a stage that writes a model
            (out / "model").mkdir()
        if cmd[0] in ("reward", "ppo", "evaluate"):
            shutil.copy(OUTPUTS / cmd[0] / "metrics.json", out / "metrics.json")
        if cmd[0] == "ppo":
            shutil.copy(OUTPUTS / "ppo" / "train.tsv", out / "train.tsv")
        if cmd[0] == "compare":
            m, seed = committed("compare"), args.loaded.ppo.seed
            metrics = {"sft": m["sft"], "win_rate": {}}
            for name in (p.split("=", 1)[0] for p in args.policy):
                method = name.split("_")[0]
                metrics[name] = {**m[method], "gold": m[method]["gold"] + seed}
                for key in ("gold", "gold_low", "gold_high", "rm"):
                    metrics["win_rate"][f"{name}_vs_sft_{key}"] = m["win_rate"][f"{method}_vs_sft_{key}"]
            for n in args.loaded.compare.best_of_n:
                metrics[f"best_of_{n}"] = m[f"best_of_{n}"]
            if args.loaded.compare.best_of_n:   # the gaps to best-of-n, of the method each name starts with
                metrics["frontier"] = {f"{name}_gap_gold{end}": m["frontier"][f"{name.split('_')[0]}_gap_gold{end}"]
                                       for name in (p.split("=", 1)[0] for p in args.policy)
                                       for end in ("", "_low", "_high")}
            (out / "metrics.json").write_text(json.dumps(metrics))
        return seconds[cmd[0]]
    return stage


def test_seed_grid_runs_the_stages_and_tabulates_each_run(tmp_path, own_sys_path, monkeypatch, capsys):
    """benchmarks/seed_grid.py: `stage` itself runs `python -m pipeline` (here its cheapest command,
    `check`) and stops the grid on a failure; `main` over two runs sharing an upstream seed, with the
    stages answered by fake_stages: the stage order and thread counts, the params each run gets (its
    seeds and a -S override), upstream models trained once, and the rows (JSON with the machine, then
    TSV) holding the committed run's values where the script reads them."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))   # as when run as a script: it imports demo_seeds
    bench = load("seed_grid")
    from pipeline.measurement.collapse import collapse_iteration, gold_per_iteration

    log = tmp_path / "check.log"   # `check` reads the params and writes nothing: run in the checkout, on its code
    assert bench.stage(["check", "--params", "params.yaml"], ROOT, 1, log) > 0
    assert "params.yaml: ok" in log.read_text()
    # A stage that fails stops the grid, naming its log (an interpreter that always fails: a real
    # stage's start costs seconds of imports).
    with monkeypatch.context() as patch, \
            pytest.raises(SystemExit, match=rf"stage check failed \(exit 1\); see {re.escape(str(log))}"):
        patch.setattr(bench, "sys", types.SimpleNamespace(executable=shutil.which("false"), exit=sys.exit))
        bench.stage(["check", "--params", "params.yaml"], tmp_path, 1, log)
    assert bench.parse_value("[1, 2]") == [1, 2] and bench.parse_value("0.05") == 0.05

    calls: list = []
    seconds = {"prepare": 1.0, "sft": 12.34, "reward": 23.45, "ppo": 34.56, "evaluate": 45.67}
    monkeypatch.setattr(bench, "stage", fake_stages(calls, seconds))
    work = tmp_path / "work"
    monkeypatch.setattr("sys.argv", ["seed_grid", "--runs", "0:0:1", "0:1:1", "-S", "ppo.kl_coef=0.05",
                                     "--keep", str(work), "--out", str(tmp_path / "grid.json"), "--tag", "_x"])
    assert bench.main() == 0
    assert calls == [("prepare", 2), ("sft", 1), ("reward", 1), ("ppo", 1), ("evaluate", 1), ("ppo", 1), ("evaluate", 1)]
    from pipeline.config import load_params
    for name, ppo_seed in (("u0_p0_t1_x", 0), ("u0_p1_t1_x", 1)):
        p = load_params(work / f"params_{name}.yaml")
        assert (p.sft.seed, p.reward.seed, p.ppo.seed, p.ppo.kl_coef) == (0, 0, ppo_seed, 0.05)
        assert (work / name / "evaluate" / "metrics.json").is_file()
    assert (work / "dvc.yaml").is_file() and not (work / "outputs").exists()   # the tracked files, no run

    result = json.loads((tmp_path / "grid.json").read_text())
    assert (result["threads"], result["overrides"]) == ("1", ["ppo.kl_coef=0.05"])
    assert f"{os.cpu_count()} cores" in result["machine"]
    ev, ppo, rm = committed("evaluate"), committed("ppo"), committed("reward")["eval"]
    want = {"gold_win": ev["win_rate"]["ppo_vs_sft_gold"], "gold_win_low": ev["win_rate"]["ppo_vs_sft_gold_low"],
            "gold_win_high": ev["win_rate"]["ppo_vs_sft_gold_high"], "rm_win": ev["win_rate"]["ppo_vs_sft_rm"],
            "ppo_gold": ev["ppo"]["gold"], "sft_gold": ev["sft"]["gold"], "ppo_rm": ev["ppo"]["rm"],
            "ppo_kl": ev["ppo"]["kl"], "rm_accuracy": rm["accuracy"], "rm_accuracy_of_ceiling": rm["accuracy_of_ceiling"],
            "detector_first_fire": ppo["detector"]["first_fire"],
            "collapse_iteration": collapse_iteration(gold_per_iteration(OUTPUTS / "ppo" / "train.tsv"), ev["sft"]["gold"]),
            "sft_seconds": 12.3, "reward_seconds": 23.4, "ppo_seconds": 34.6, "evaluate_seconds": 45.7}
    assert [r["run"] for r in result["runs"]] == ["0:0:1", "0:1:1"]
    for row in result["runs"]:
        assert {k: row[k] for k in want} == want and list(row) == bench.COLUMNS
    assert f"gold_win   median {want['gold_win']:.3f}" in capsys.readouterr().out

    # Again in the same work folder, as a TSV: the upstream models are reused, their times kept.
    calls.clear()
    monkeypatch.setattr("sys.argv", ["seed_grid", "--runs", "0:2:1", "--keep", str(work), "--out",
                                     str(tmp_path / "grid.tsv")])
    assert bench.main() == 0
    assert calls == [("prepare", 2), ("ppo", 1), ("evaluate", 1)]
    with open(tmp_path / "grid.tsv", newline="") as f:
        (row,) = list(csv.DictReader(f, delimiter="\t"))
    assert list(row) == bench.COLUMNS and row["run"] == "0:2:1"
    assert {k: float(row[k]) for k in ("gold_win", "ppo_kl", "sft_seconds", "ppo_seconds")} == \
        {k: want[k] for k in ("gold_win", "ppo_kl", "sft_seconds", "ppo_seconds")}


def test_ppo_variants_collects_its_tables_over_an_earlier_file(tmp_path, own_sys_path, monkeypatch):
    """benchmarks/ppo_variants.py --collect --base: a variant measured again on a seed replaces that
    seed's run and keeps the others; a variant not measured again is kept whole, with the overrides
    VARIANTS gives it now; each run keeps its date;
    the frontier columns a table lacks are read from the run's evaluate metrics."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))   # as when run as a script: it imports demo_seeds
    bench = load("ppo_variants")
    run = lambda r, gold: {"run": r, "ppo_gold": gold, **{k: None for k in bench.FRONTIER}}   # noqa: E731
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"machine": "m", "date": "2026-01-01", "variants": [
        {"name": "adaptc20", "overrides": bench.VARIANTS["adaptc20"], "runs": [run("0:0:2", 1.0), run("2:2:2", 2.0)]},
        {"name": "fixed", "overrides": bench.VARIANTS["fixed"][:-1], "runs": [run("0:0:2", 3.0)]}]}))
    keep = tmp_path / "keep"
    keep.mkdir()
    again = {k: v for k, v in run("2:2:2", 2.5).items() if k not in ("ppo_gap_gold", "ppo_beyond_best_of_n")}
    (keep / "variant_adaptc20.json").write_text(json.dumps({"date": "2026-02-02", "runs": [again]}))
    (keep / "variant_i200.json").write_text(json.dumps({"date": "2026-02-03", "runs": [run("2:2:2", 4.0)]}))
    frontier = keep / "u2_p2_t2_adaptc20/evaluate/metrics.json"
    frontier.parent.mkdir(parents=True)
    frontier.write_text(json.dumps({"frontier": {"ppo_gap_gold": -0.25, "ppo_beyond_best_of_n": False}}))
    result = bench.collect(keep, tmp_path / "out.json", base)
    assert json.loads((tmp_path / "out.json").read_text()) == result
    got = {v["name"]: v for v in result["variants"]}
    assert [v["name"] for v in result["variants"]] == [n for n in bench.VARIANTS if n in got] \
        and set(got) == {"adaptc20", "fixed", "i200"}
    assert [(r["run"], r["ppo_gold"]) for r in got["adaptc20"]["runs"]] == [("0:0:2", 1.0), ("2:2:2", 2.5)]
    assert got["adaptc20"]["runs"][1]["ppo_gap_gold"] == -0.25 and got["adaptc20"]["runs"][1]["ppo_beyond_best_of_n"] is False
    assert [(r["run"], r["ppo_gold"]) for r in got["fixed"]["runs"]] == [("0:0:2", 3.0)]
    assert {(n, r["run"]): r["date"] for n, v in got.items() for r in v["runs"]} == {
        ("adaptc20", "0:0:2"): "2026-01-01", ("adaptc20", "2:2:2"): "2026-02-02", ("fixed", "0:0:2"): "2026-01-01",
        ("i200", "2:2:2"): "2026-02-03"}
    assert result["date"] == "2026-02-03" and got["i200"]["overrides"] == bench.VARIANTS["i200"]
    # a variant kept from the base file is labelled as VARIANTS names it now (its count made explicit)
    assert got["fixed"]["overrides"] == bench.VARIANTS["fixed"] and "ppo.iterations=100" in got["fixed"]["overrides"]


def test_compare_methods_runs_every_method_seed_and_sweep_and_tabulates_them(tmp_path, own_sys_path, monkeypatch,
                                                                           capsys):
    """benchmarks/compare_methods.py's `main` over two seeds of PPO and DPO and the DPO beta sweep,
    the stages answered by fake_stages: which stages run (the sweep's default beta reuses seed 0's DPO
    instead of training it again; one compare measures every beta), the params each gets (the methods'
    seeds, best-of-n on seed 0 and the sweep only, the swept beta), the table's rows holding the compare
    stage's numbers and gaps to best-of-n, the medians over seeds, and the plot. The methods' real training is the methods' own tests' (tests/stages/test_dpo.py,
    test_grpo.py, test_rs.py)."""
    bench = load("compare_methods")
    root = tmp_path / "checkout"           # the workspace's SFT and RM the script insists on
    for what in ("sft", "reward"):
        (root / "outputs" / what / "model").mkdir(parents=True)
    monkeypatch.setattr(bench, "ROOT", root)
    calls: list = []
    seconds = dict.fromkeys(("prepare", "ppo", "dpo", "compare"), 1.0)
    monkeypatch.setattr(bench, "stage", fake_stages(calls, seconds))
    work, table, png = tmp_path / "work", tmp_path / "methods.tsv", tmp_path / "methods.png"
    monkeypatch.setattr("sys.argv", ["compare_methods", "--seeds", "0", "1", "--methods", "ppo", "dpo", "--sweep",
                                     "dpo", "--keep", str(work), "--out", str(table), "--plot", str(png)])
    assert bench.main() == 0
    default_beta = bench.default_value(work / "params.yaml", "dpo.beta")
    betas = bench.SWEEPS["dpo"][1]
    assert default_beta in betas and {0.5, 1.0, 2.0} <= set(betas)
    assert [c for c, _ in calls] == ["prepare", "ppo", "dpo", "compare", "ppo", "dpo", "compare",
                                     *["dpo"] * (len(betas) - 1), "compare"]

    from pipeline.config import load_params
    s0, s1 = load_params(work / "params_s0.yaml"), load_params(work / "params_s1.yaml")
    assert (s0.ppo.seed, s0.dpo.seed, s0.compare.best_of_n) == (0, 0, (4, 16, 64))
    assert (s1.ppo.seed, s1.dpo.seed, s1.compare.best_of_n) == (1, 1, ())
    swept = load_params(work / f"params_s0_dpo{betas[0]}.yaml")
    assert (swept.dpo.beta, swept.dpo.seed) == (betas[0], 0)
    assert load_params(work / "params_s0_dpo.yaml").compare.best_of_n == (4, 16, 64)
    assert not (work / f"params_s0_dpo{default_beta}.yaml").exists()   # not trained again

    m = committed("compare")
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert [(r["method"], r["seed"], r["sweep"]) for r in rows] == \
        [("ppo", "0", ""), ("dpo", "0", ""), ("ppo", "1", ""), ("dpo", "1", "")] + \
        [("dpo", "0", f"dpo.beta={b}") for b in betas]
    for r in rows:
        p, w = m[r["method"]], m["win_rate"]
        assert float(r["gold"]) == pytest.approx(p["gold"] + int(r["seed"]))
        assert [float(r[c]) for c in ("gold_ci95", "rm", "kl", "length", "wall_seconds", "peak_rss_gib")] == \
            [p["gold_ci95"], p["rm"], p["kl"], p["length"], p["stage_wall_seconds"], p["stage_peak_rss_gib"]]
        assert [float(r[c]) for c in ("gold_win", "gold_win_low", "gold_win_high", "rm_win")] == \
            [w[f"{r['method']}_vs_sft_{k}"] for k in ("gold", "gold_low", "gold_high", "rm")]
        gaps = [float(r[c]) for c in ("gap", "gap_low", "gap_high")]
        # null (NaN written as null) where not measured: past best-of-n's KL, or an interval at its end
        want = [math.nan if v is None else v for v in (m["frontier"][f"{r['method']}_gap_gold{end}"]
                                                        for end in ("", "_low", "_high"))]
        if r["seed"] == "1" or math.isnan(want[0]):   # no best-of-n in seed 1's compare; past its KL
            assert all(math.isnan(g) for g in gaps), r
        else:
            assert all(g == w or math.isnan(g) and math.isnan(w) for g, w in zip(gaps, want)) and want[0] < 0, r
    out = capsys.readouterr().out
    for method in ("ppo", "dpo"):   # the median of seeds 0 and 1: gold + 0.5
        g = m[method]["gold"]
        assert f"  {method:5s} n=2  gold {g + 0.5:.3f} ({g:.3f} .. {g + 1:.3f})" in out, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # rows_of reads every policy the compare stage measured, by the name it was given.
    assert [r["gold"] for r in bench.rows_of(work / "s0" / "compare", {"dpo": ("dpo", 0, ""), "ppo": ("ppo", 0, "")})] \
        == [m["dpo"]["gold"], m["ppo"]["gold"]]


def test_compare_methods_merge_replaces_only_what_a_run_measured_again(tmp_path, own_sys_path):
    """`--merge`: a run of one method's seeds replaces that method's seed rows and keeps its sweep
    rows and every other method's; a run of its sweep replaces the sweep rows only."""
    bench = load("compare_methods")

    def row(method, seed, sweep, gold):
        return {**dict.fromkeys(bench.COLUMNS, 1.0), "method": method, "seed": seed, "sweep": sweep, "gold": gold}
    table = tmp_path / "old.tsv"
    old = [row("ppo", 0, "", 2.7), row("grpo", 0, "", 2.5), row("grpo", 1, "", 2.6),
           row("grpo", 0, "grpo.kl_loss_coef=0.1", 2.4), row("dpo", 0, "dpo.beta=0.1", 1.3)]
    with table.open("w", newline="") as f:
        w = csv.DictWriter(f, bench.COLUMNS, delimiter="\t")
        w.writeheader()
        w.writerows(old)
    seeds = bench.merged(table, [row("grpo", 0, "", 2.2), row("grpo", 2, "", 2.3)])
    assert [(r["method"], r["seed"], r["sweep"], r["gold"]) for r in seeds] == [
        ("ppo", 0, "", 2.7), ("grpo", 0, "grpo.kl_loss_coef=0.1", 2.4), ("dpo", 0, "dpo.beta=0.1", 1.3),
        ("grpo", 0, "", 2.2), ("grpo", 2, "", 2.3)]
    swept = bench.merged(table, [row("grpo", 0, "grpo.kl_loss_coef=0.3", 2.0)])
    assert [(r["method"], r["sweep"]) for r in swept] == [
        ("ppo", ""), ("grpo", ""), ("grpo", ""), ("dpo", "dpo.beta=0.1"), ("grpo", "grpo.kl_loss_coef=0.3")]
    # A table from before the gap columns: its rows come back with those not measured (NaN).
    older = [c for c in bench.COLUMNS if not c.startswith("gap")]
    with table.open("w", newline="") as f:
        w = csv.DictWriter(f, older, delimiter="\t", extrasaction="ignore")
        w.writeheader()
        w.writerows(old)
    kept = bench.merged(table, [row("grpo", 0, "", 2.2)])
    assert [r["gold"] for r in kept] == [2.7, 2.4, 1.3, 2.2]
    assert all(math.isnan(r["gap"]) for r in kept[:3]) and kept[3]["gap"] == 1.0
