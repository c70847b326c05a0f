"""The real pipeline end to end: `dvc repro` on tiny params in a temporary git repository."""

import json
import math
import re
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from conftest import BIN, bare_env, run
from pipeline.config import load_params
from pipeline.stages import evaluate as evaluate_stage, ppo as ppo_stage, reward as reward_stage, sft as sft_stage
from pipeline.stages.spec import resolve
from pipeline.stages import registry
from pipeline.stages.metric_registry import check_run
from pipeline.data.tokenizer import decode_response, encode_prompt


@pytest.mark.long
def test_dvc_repro_tiny_pipeline(tiny_run, tiny_run_copy):
    # The shared run is `.venv/bin/dvc repro` as the README writes it, from a shell without the venv
    # on PATH; this test checks what it wrote, then works on in its own copy.
    assert "Running stage 'sft'" in tiny_run.printed
    repo = tiny_run_copy

    stats = json.loads((repo / "data/prepared/stats.json").read_text())
    assert stats["sizes"]["sft_train"] == 64 and stats["sizes"]["eval_prompts"] == 8
    assert 0.5 < stats["noise_ceiling"]["pairs_eval"] <= 1.0

    metrics = json.loads((repo / "outputs/sft/metrics.json").read_text())
    assert metrics["train"]["steps"] == 4                       # 64 demos / batch 16, one epoch
    assert 0 < metrics["eval"]["loss"] < 10
    for end in ("_greedy", ""):                                  # greedy and sampled responses
        assert 0.0 <= metrics["sft"][f"eos_rate{end}"] <= 1.0
        assert -10 < metrics["sft"][f"gold{end}"] < 5
    train_rows = (repo / "outputs/sft/train.tsv").read_text().splitlines()
    assert train_rows[0].split("\t") == ["step", "loss", "lr", "grad_norm", "skipped_updates"] and len(train_rows) == 5

    # The checkpoint is a plain HF one: Auto classes load it (safetensors) and it generates.
    path = repo / "outputs/sft/model"
    assert (path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = torch.tensor([encode_prompt(tok, "Review the film Silent River . Focus on the music .")])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(decode_response(tok, out[0, ids.shape[1]:].tolist()), str)

    # The reward model: a sequence classifier with the normalisation offset in its config.
    rm_metrics = json.loads((repo / "outputs/reward/metrics.json").read_text())["eval"]
    assert 0.0 <= rm_metrics["accuracy"] <= 1.0 and 0.0 <= rm_metrics["calibration_error"] <= 1.0
    assert rm_metrics["noise_ceiling"] == stats["noise_ceiling"]["pairs_eval"]
    assert -1.0 <= rm_metrics["spearman_gold_heldout"] <= 1.0
    assert 0.0 <= rm_metrics["gold_order_agreement"] <= 1.0
    # null when the few tiny-model samples all get one gold score (a rank correlation is undefined then)
    assert rm_metrics["spearman_gold_sft_samples"] is None or -1.0 <= rm_metrics["spearman_gold_sft_samples"] <= 1.0
    reward = AutoModelForSequenceClassification.from_pretrained(str(repo / "outputs/reward/model"))
    assert reward.config.num_labels == 1
    assert reward.config.reward_offset == rm_metrics["offset"]
    assert (repo / "outputs/reward/calibration.png").read_bytes()[:4] == b"\x89PNG"

    # PPO: three iterations logged, every metric present, the actor saved as a plain HF checkpoint.
    ppo_rows = (repo / "outputs/ppo/train.tsv").read_text().splitlines()
    header = ppo_rows[0].split("\t")
    assert len(ppo_rows) == 4
    for name in ("objective/rlhf_reward", "objective/scores", "objective/kl", "objective/non_score_reward",
                 "objective/entropy", "policy/approxkl", "policy/clipfrac", "loss/policy", "loss/value",
                 "val/clipfrac", "val/ratio", "val/ratio_max", "val/explained_variance", "val/num_eos_tokens",
                 "kl_coef", "lr", "time/rollout", "time/scoring", "time/update", "objective/gold_scores",
                 "objective/distinct_2", "detector/kl_rise", "detector/fired", "detector/first_fire"):
        assert name in header, name
    ppo = json.loads((repo / "outputs/ppo/metrics.json").read_text())
    for name in ("sft/gold", "ppo/gold", "ppo/gold_gain", "ppo/kl", "ppo/rm", "sft/rm"):
        policy, key = name.split("/")
        assert isinstance(ppo[policy][key], float) and isinstance(ppo[policy][key + "_ci95"], float)
    assert ppo["sft"]["kl"] == 0.0                            # the reference against itself
    detector = json.loads((repo / "outputs/ppo/metrics.json").read_text())["detector"]
    assert detector == {"first_fire": 0, "fired": 0, "stopped_at": 0, "kept_iteration": 3}   # 3 < warmup
    AutoModelForCausalLM.from_pretrained(str(repo / "outputs/ppo/model"))

    # Evaluate: every policy measured, win rates with intervals, best-of-n KL by its formula.
    ev = json.loads((repo / "outputs/evaluate/metrics.json").read_text())
    for policy in ("sft", "best_of_2", "best_of_3", "ppo"):
        assert -10 < ev[policy]["gold"] < 5 and 0 <= ev[policy]["eos_rate"] <= 1
        assert 0 <= ev[policy]["distinct_2"] <= 1 and ev[policy]["length"] > 0
    for n in (2, 3):
        assert ev[f"best_of_{n}"]["kl"] == pytest.approx(math.log(n) - (n - 1) / n)
    # Nested best-of-n: the favourite of 3 samples scores at least the favourite of the first 2.
    assert ev["best_of_3"]["rm"] >= ev["best_of_2"]["rm"]
    assert ev["sft"]["kl"] == 0.0
    for key in ("gold", "rm"):
        w = ev["win_rate"]
        assert 0 <= w[f"ppo_vs_sft_{key}_low"] <= w[f"ppo_vs_sft_{key}"] <= w[f"ppo_vs_sft_{key}_high"] <= 1
    assert ev["overoptimisation"]["win_rate_gap"] == pytest.approx(w["ppo_vs_sft_rm"] - w["ppo_vs_sft_gold"])
    report = (repo / "outputs/evaluate/report.md").read_text()
    assert "![scores](scores.png)" in report and "| ppo |" in report and "| best_of_3 |" in report
    # The verdict is the report's first paragraph; the detector's record came from outputs/ppo.
    verdict = report.splitlines()[2]
    assert verdict.startswith("**") and "the over-optimisation detector stayed quiet" in verdict
    for png in ("scores.png", "kl_frontier.png"):
        assert (repo / "outputs/evaluate" / png).read_bytes()[:4] == b"\x89PNG"

    # Each stage's config.json is its declaration resolved against the params (and nothing else).
    params = load_params(repo / "params.yaml")
    for module in (sft_stage, reward_stage, ppo_stage, evaluate_stage):
        written = json.loads((repo / "outputs" / module.SPEC.name / "config.json").read_text())
        threads = int(tiny_run.threads) if tiny_run.threads else torch.get_num_threads()   # what the run had
        # A training stage also says what its weights, optimizer states and forwards were in.
        dtypes = {"dtypes": {"weights": "float32", "optimizer_states": "float32", "compute": "float32"}}
        assert written.pop("runtime") == {"device": "cpu", "processes": 1, "threads": threads,
                                          **(dtypes if module.SPEC.training else {})}, module.SPEC.name
        assert written == resolve(params, module.SPEC), module.SPEC.name

    # Every name the run wrote is defined in docs/metrics.md's registry, and every name defined
    # for these conditions was written.
    assert check_run(repo / "outputs") == ([], [])

    # The methods side by side: compare/dvc.yaml on the finished default pipeline runs only its own
    # stages (the plain `dvc repro` above ran none of them), then its comparison of every policy.
    assert not (repo / "outputs/dpo").exists()
    proc = run([str(BIN / "dvc"), "repro", "compare/dvc.yaml"], repo, env=bare_env(repo))
    ran = re.findall(r"Running stage '([^']+)'", proc.stdout)
    compare_stages = [n for n, s in registry.specs().items() if s.pipeline == "compare"]
    assert sorted(ran) == sorted(f"compare/dvc.yaml:{s}" for s in compare_stages), ran
    compared = json.loads((repo / "outputs/compare/metrics.json").read_text())
    methods = list(registry.methods())   # ppo, dpo, kto, grpo, rs
    for policy in ("sft", "best_of_2", *methods):
        assert math.isfinite(compared[policy]["gold"]) and math.isfinite(compared[policy]["kl"]), policy
    for policy in methods:
        assert 0.0 <= compared["win_rate"][f"{policy}_vs_sft_gold"] <= 1.0
        assert compared[policy]["stage_wall_seconds"] > 0 and compared[policy]["stage_peak_rss_gib"] > 0
    # The PPO policy is measured on the same prompts with the same seed as evaluate: same numbers.
    evaluated = json.loads((repo / "outputs/evaluate/metrics.json").read_text())
    assert compared["ppo"]["gold"] == evaluated["ppo"]["gold"] and compared["sft"]["rm"] == evaluated["sft"]["rm"]
    assert (repo / "outputs/grpo/checkpoint/actor.safetensors").is_file()   # no critic: three models, not four
    assert not list((repo / "outputs/grpo").rglob("critic*"))
    assert (repo / "outputs/compare/gold_vs_kl.png").read_bytes()[:4] == b"\x89PNG"
    assert check_run(repo / "outputs", {"compare"}) == ([], [])

    # The README's `dvc repro -f`: SFT re-runs from its final checkpoint and writes every output again.
    logs = {n: (repo / "outputs/sft" / n).read_bytes() for n in ("train.tsv", "eval.tsv")}
    run([str(BIN / "dvc"), "repro", "-f", "-s", "sft"], repo)
    assert {n: (repo / "outputs/sft" / n).read_bytes() for n in logs} == logs

    # Nothing changed: a second repro runs no stage; a params change reruns only what reads it.
    assert "didn't change" in run([str(BIN / "dvc"), "repro"], repo).stdout
    params = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(params.replace("calibration_bins: 10", "calibration_bins: 5"))
    status = json.loads(run([str(BIN / "dvc"), "status", "--json"], repo).stdout)
    assert set(status) == {"reward"}
    (repo / "params.yaml").write_text(params.replace("lr: 0.002", "lr: 3e-05"))
    status = json.loads(run([str(BIN / "dvc"), "status", "--json"], repo).stdout)
    assert set(status) == {"sft"}             # reward reruns after, when the SFT model changes


@pytest.mark.long
def test_dvc_exp_run_changes_param_and_reports_eval_metrics(tiny_run_copy):
    """`dvc exp run -S ppo.kl_coef=...` gives an experiment whose params and evaluate metrics
    line up in `dvc exp show`, next to the baseline (the shared finished run)."""
    repo = tiny_run_copy
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A"], repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "baseline"], repo)
    bare = bare_env(repo)   # the README's `.venv/bin/dvc exp run`, no venv on PATH
    # A fixed coefficient (the default adapts it from kl_coef towards ppo.kl_target): two keys at once.
    run([str(BIN / "dvc"), "exp", "run", "-n", "kl-low", "-S", "ppo.kl_coef=0.05", "-S", "ppo.adaptive_kl=false"],
        repo, env=bare)
    import dvc.api
    rows = {row["Experiment"] or row["rev"]: row for row in dvc.api.exp_show(repo=str(repo))}
    assert "kl-low" in rows

    def find(row, suffix):
        return [v for k, v in row.items() if k.endswith(suffix)]
    assert find(rows["kl-low"], "ppo.kl_coef") == [0.05]
    baseline = next(r for name, r in rows.items() if name not in ("kl-low", "workspace"))
    assert find(baseline, "ppo.kl_coef") == [0.2]
    for row in (rows["kl-low"], baseline):
        # PPO's gold score twice, one column per file: the PPO stage's own measurement and evaluate's.
        gold = {k: v for k, v in row.items() if k.endswith("ppo.gold")}
        assert len(gold) == 2 and all(isinstance(v, float) for v in gold.values()), gold
        assert sorted("evaluate" in k for k in gold) == [False, True], gold
    # The experiment re-ran PPO with the new penalty: its logged kl_coef is the new one; the
    # baseline's is the adaptive controller's, moved from 0.2 by at most 0.2 / horizon of itself per
    # iteration before the last.
    adaptive = [[str(v) for v in find(row, "ppo.adaptive_kl")] for row in (rows["kl-low"], baseline)]
    assert adaptive == [["False"], ["True"]]   # exp_show gives a bool as its text
    assert find(rows["kl-low"], "train.kl_coef") == [0.05]
    (coef,) = find(baseline, "train.kl_coef")
    (iterations,), (horizon,) = find(baseline, "ppo.iterations"), find(baseline, "ppo.kl_horizon_iterations")
    assert coef != 0.2 and abs(math.log(coef / 0.2)) <= (iterations - 1) * -math.log(1 - 0.2 / horizon) + 1e-6

    # A queued experiment runs in a fresh copy without the (gitignored) resumable checkpoints; it
    # too re-runs only the stages its param reaches.
    dvc = str(BIN / "dvc")
    # `dvc queue start` starts its workers as `dvc` from PATH: queues need the venv activated (README).
    run([dvc, "exp", "run", "--queue", "-n", "kl-queued", "-S", "ppo.kl_coef=0.1"], repo)
    run([dvc, "queue", "start"], repo)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not re.search(r"Success|Failed", status := run([dvc, "queue", "status"], repo).stdout):
        time.sleep(3)
    log = run([dvc, "queue", "logs", "kl-queued"], repo, check=False).stdout
    assert "Success" in status, status + log
    for stage in ("prepare", "sft", "reward"):
        assert f"Stage '{stage}' didn't change, skipping" in log, log
    assert "Running stage 'ppo'" in log and "Running stage 'evaluate'" in log



def test_every_model_folder_carries_a_card_and_the_reward_model_scores_without_this_project(tiny_run):
    from huggingface_hub import ModelCard
    from model_cards import card_code
    from pipeline.models import reward_model as rm
    repo = tiny_run.repo
    for stage in ("sft", "reward", "ppo"):
        card = (repo / "outputs" / stage / "model" / "README.md").read_text()
        header = ModelCard(card).data
        assert (header.library_name, header.license) == ("transformers", "apache-2.0")
        assert stage in header.tags
        metrics = json.loads((repo / "outputs" / stage / "metrics.json").read_text())
        # The held-out evaluation, with the policies measured under their own names (ppo/rm, sft/gold).
        measured = {f"{group}/{key}": value for group in ("eval", stage, "sft") for key, value in metrics.get(group, {}).items()}
        assert any(k.startswith(f"{stage}/") for k in measured) == (stage != "reward")
        for key, value in measured.items():
            if isinstance(value, float):
                assert f"| `{key}` | {value:.4g} |" in card, (stage, key)
        assert f"| `{stage}.seed` | 0 |" in card
        assert "seconds" not in card     # no times: a re-run training the same weights writes the same folder
    # The card's snippet, run with plain transformers, gives the pipeline's own scores (the offset in
    # the config subtracted).
    from pipeline.tracking import model_card
    assert model_card.OFFSET_KEY == rm.OFFSET_KEY
    folder = repo / "outputs" / "reward" / "model"
    snippet = card_code((folder / "README.md").read_text(), folder)
    ours, tok = rm.load_reward_model(folder)
    prompt, response = "Review the film Silent River . Focus on the music .", "The music is warm ."
    assert snippet["score"](prompt, response) == pytest.approx(
        rm.score_texts(ours, tok, [prompt], [response], 96).item(), abs=1e-5)
    assert abs(snippet["model"].config.reward_offset) > 0
