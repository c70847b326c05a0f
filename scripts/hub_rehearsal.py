"""The hub path rehearsed on a CPU: the default task from a checkpoint packaged as hub checkpoints are.

    python scripts/hub_rehearsal.py base            # writes hub-rehearsal/base
    python -m pipeline recipe hub-rehearsal && dvc repro

    make hub-rehearsal                              # both, in a copy of the project (.rehearsal/)
    python scripts/hub_rehearsal.py master-weights --code PATH   # bf16 base vs its fp32 upcast

`base` builds a Qwen2.5-shaped checkpoint (pipeline/workflow/hub_rehearsal.py says how): bf16
safetensors, a byte-level BPE with the ChatML template, two end ids in generation_config.json, no
pad token, tied embeddings; it knows the task's language, as an instruct model knows its own.
`run` (what `make hub-rehearsal` calls) copies the project without its committed run, builds the
base there, merges recipes/hub-rehearsal.yaml and runs `dvc repro`; it writes what it measured to
hub-rehearsal.json beside the copy (`--record`: to docs/data/hub-rehearsal.json as well).
`master-weights` runs the recipe's SFT stage with the code of checkout PATH from the bf16 base and
from its exact fp32 upcast: a pipeline that keeps fp32 master weights trains both alike; one that
trains the weights in the dtype they were saved in shows the gap (loss, share of weights moved).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

RECIPE = ROOT / "recipes" / "hub-rehearsal.yaml"
BASE = Path("hub-rehearsal/base")   # where the recipe's model.name_or_path points, from the checkout
# The base's own training: the pipeline's SFT at the default task's learning rate, long enough that
# the base samples well-formed reviews (its measurement is printed when it ends).
BASE_SFT = {"epochs": 8.0, "max_length": 128, "n_eval_generations": 50, "eval_every": 1000, "save_every": 1000}


def _yaml(path: Path) -> dict:
    from ruamel.yaml import YAML
    return YAML(typ="safe", pure=True).load(path.read_text(encoding="utf-8"))


def _write_params(path: Path, params_file: Path, over: dict) -> Path:
    from ruamel.yaml import YAML

    from pipeline.workflow.recipes import merge
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        YAML().dump(merge(_yaml(params_file), over), f)
    return path


def _stage(python: str, code: Path, stage: str, params: Path, data: Path, out: Path) -> None:
    """One stage through the command line of checkout `code`, untracked, its log on our stderr."""
    env = {**os.environ, "PIPELINE_TRACKING": "off"}
    subprocess.run([python, "-m", "pipeline", stage, "--params", str(params), "--data", str(data), "--out", str(out)],
                   cwd=code, env=env, check=True)


def build_base(out: Path, data_over: dict | None = None, sft_over: dict | None = None) -> Path:
    """The rehearsal's base in `out`: a random Qwen2.5-shaped checkpoint trained by this checkout's
    SFT stage on the default task's demonstrations (`data_over`, `sft_over`: smaller, for tests),
    then packaged as a hub release."""
    from pipeline.config import DataConfig, from_dict
    from pipeline.stages import prepare
    from pipeline.workflow import hub_rehearsal

    out = Path(out).resolve()
    work = out.parent / f".{out.name}.build"
    shutil.rmtree(work, ignore_errors=True)
    print(f"hub-rehearsal: building {out} (a random Qwen2.5-shaped model, then SFT on the task)", flush=True)
    data_cfg = dict(_yaml(ROOT / "params.yaml")["data"], **(data_over or {}))
    prepare.write(from_dict(DataConfig, data_cfg, "data"), work / "prepared")
    hub_rehearsal.random_base(work / "raw")
    params = _write_params(work / "params.yaml", ROOT / "params.yaml",
                           {"data": data_cfg, "model": {"name_or_path": str(work / "raw")},
                            "sft": {**BASE_SFT, **(sft_over or {})}})
    _stage(sys.executable, ROOT, "sft", params, work / "prepared", work / "sft")
    hub_rehearsal.as_hub(work / "sft" / "model", out)
    shutil.rmtree(work, ignore_errors=True)
    print(f"hub-rehearsal: wrote {out} (bf16 safetensors, ChatML, ends <|im_end|> and <|endoftext|>, no pad)",
          flush=True)
    return out


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file
    return {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}


def share_moved(before: Path, after: Path) -> float:
    """The share of weight values that differ between two checkpoints (compared in fp32)."""
    a, b = _weights(before), _weights(after)
    moved = sum(int((a[k] != b[k]).sum()) for k in a)
    return moved / sum(v.numel() for v in a.values())


def master_weights(base: Path, code: Path, work: Path) -> dict[str, Any]:
    """The recipe's SFT stage, with checkout `code`'s own code and params.yaml, from `base` (bf16)
    and from its fp32 upcast: final loss, held-out loss and the share of weights each moved."""
    from pipeline.stages import prepare
    from pipeline.config import DataConfig
    from pipeline.workflow import hub_rehearsal

    shutil.rmtree(work, ignore_errors=True)
    prepare.write(DataConfig(), work / "prepared")
    bases = {"bf16": Path(base).resolve(), "fp32_upcast": hub_rehearsal.upcast(base, work / "fp32")}
    recipe = _yaml(RECIPE)
    python = str(code / ".venv" / "bin" / "python")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code, capture_output=True, text=True).stdout.strip()
    runs: dict[str, Any] = {}
    for name, folder in bases.items():
        params = _write_params(work / f"params-{name}.yaml", code / "params.yaml",
                               {"model": {"name_or_path": str(folder)}, "sft": recipe["sft"]})
        start = time.monotonic()
        _stage(python, code, "sft", params, work / "prepared", work / f"sft-{name}")
        metrics = json.loads((work / f"sft-{name}" / "metrics.json").read_text())
        runs[name] = {"train_loss": metrics["train"]["loss"], "eval_loss": metrics["eval"]["loss"],
                      "steps": metrics["train"]["steps"], "seconds": round(time.monotonic() - start, 1),
                      "share_of_weights_moved": share_moved(bases["fp32_upcast"], work / f"sft-{name}" / "model"),
                      "saved_dtype": json.loads((work / f"sft-{name}" / "model" / "config.json").read_text()).get("dtype")}
    import torch
    a, b = _weights(work / "sft-bf16" / "model"), _weights(work / "sft-fp32_upcast" / "model")
    return {"code": rev, "lr": recipe["sft"]["lr"], "threads": torch_threads(), **runs,
            "identical_weights": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "eval_loss_gap": runs["bf16"]["eval_loss"] - runs["fp32_upcast"]["eval_loss"],
            "train_loss_gap": runs["bf16"]["train_loss"] - runs["fp32_upcast"]["train_loss"]}


def torch_threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)


def summary(repo: Path, seconds: float) -> dict[str, Any]:
    """What the rehearsal shows, from the copy's outputs: the base's packaging, every stage's
    recorded dtypes, the RM's accuracy and PPO's gold against SFT with its interval."""
    read = lambda rel: json.loads((repo / rel).read_text())   # noqa: E731
    base = repo / BASE
    gen = read(BASE / "generation_config.json")
    tok = read(BASE / "tokenizer_config.json")
    ev, rm, sft = read("outputs/evaluate/metrics.json"), read("outputs/reward/metrics.json"), read("outputs/sft/metrics.json")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from demo_seeds import machine
    return {
        "date": time.strftime("%Y-%m-%d"), "seconds": round(seconds, 1), "threads": torch_threads(),
        "machine": machine(),
        "base": {"saved_dtype": read(BASE / "config.json").get("dtype"), "eos_token_id": gen.get("eos_token_id"),
                 "pad_token": tok.get("pad_token"), "tie_word_embeddings": read(BASE / "config.json").get("tie_word_embeddings"),
                 "chat_template": bool(tok.get("chat_template") or (base / "chat_template.jinja").exists()),
                 "tokenizer": tok.get("tokenizer_class")},
        "dtypes": {stage: read(f"outputs/{stage}/config.json")["runtime"].get("dtypes") for stage in ("sft", "reward", "ppo")},
        "lr": {stage: read(f"outputs/{stage}/config.json")[stage]["lr"] for stage in ("sft", "reward", "ppo")},
        "sft": {"eval_loss": sft["eval"]["loss"], "well_formed": sft["sft"]["well_formed"]},
        "reward": {"accuracy": rm["eval"]["accuracy"], "accuracy_of_ceiling": rm["eval"]["accuracy_of_ceiling"]},
        "gold": {name: {"gold": ev[name]["gold"], "ci95": ev[name]["gold_ci95"], "kl": ev[name]["kl"]}
                 for name in ev if name in ("sft", "ppo") or name.startswith("best_of_")},
        "ppo_vs_sft_gold": {k: ev["win_rate"][f"ppo_vs_sft_gold{s}"] for k, s in
                            (("win_rate", ""), ("low", "_low"), ("high", "_high"))},
    }


def run(dest: Path, record: bool) -> dict[str, Any]:
    from demo import copy_project

    start = time.monotonic()
    print(f"hub-rehearsal: copying the project to {dest} (recipes/hub-rehearsal.yaml)", flush=True)
    copy_project(dest)
    py = str(ROOT / ".venv" / "bin" / "python")
    subprocess.run([py, str(dest / "scripts" / "hub_rehearsal.py"), "base"], cwd=dest, check=True)
    subprocess.run([py, "-m", "pipeline", "recipe", "hub-rehearsal", "--params", "params.yaml"], cwd=dest, check=True,
                   stdout=subprocess.DEVNULL)
    env = {**os.environ, "PIPELINE_TRACKING": "off", "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([str(ROOT / ".venv" / "bin" / "dvc"), "repro"], cwd=dest, env=env, check=True)
    result = summary(dest, time.monotonic() - start)
    text = json.dumps(result, indent=1) + "\n"
    (dest.parent / "hub-rehearsal.json").write_text(text)
    if record:
        from pipeline.files import atomic_write_text
        atomic_write_text(ROOT / "docs" / "data" / "hub-rehearsal.json", text)
    win = result["ppo_vs_sft_gold"]
    print(f"hub-rehearsal: done in {result['seconds'] / 60:.1f} min; PPO beats SFT by the gold annotator on "
          f"{win['win_rate']:.1%} of held-out prompts (95% CI {win['low']:.1%}-{win['high']:.1%}); "
          f"report {dest / 'outputs/evaluate/report.md'}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base", help="build the hub-packaged base (default: hub-rehearsal/base)")
    b.add_argument("--out", type=Path, default=BASE)
    r = sub.add_parser("run", help="the whole rehearsal in a copy of the project")
    r.add_argument("--dir", type=Path, default=ROOT / ".rehearsal" / "repo")
    r.add_argument("--record", action="store_true", help="also write docs/data/hub-rehearsal.json")
    m = sub.add_parser("master-weights", help="SFT from the bf16 base and from its fp32 upcast, with a checkout's code")
    m.add_argument("--base", type=Path, default=BASE)
    m.add_argument("--code", type=Path, default=ROOT, help="the checkout whose code and params.yaml run (default: this)")
    m.add_argument("--work", type=Path, default=ROOT / ".rehearsal" / "master-weights")
    m.add_argument("--out", type=Path, help="add the result to this JSON list (e.g. docs/data/hub-rehearsal-master-weights.json)")
    args = ap.parse_args(argv)
    if args.cmd == "base":
        build_base(args.out)
    elif args.cmd == "run":
        run(args.dir.resolve(), args.record)
    else:
        result = master_weights(args.base, args.code.resolve(), args.work.resolve())
        print(json.dumps(result, indent=1))
        if args.out:   # a list of runs, one per checkout's code: this one's replaces its earlier run
            from pipeline.files import atomic_write_text
            earlier = json.loads(args.out.read_text()) if args.out.is_file() else []
            runs = [r for r in earlier if r.get("code") != result["code"]] + [result]
            atomic_write_text(args.out, json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
