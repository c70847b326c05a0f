"""`python -m pipeline <stage> --params params.yaml ...`: the one entry point of every stage.

The params file is loaded and validated in full before any stage starts computing. User errors
(bad params, bad data, a wrong checkpoint) print one line naming the file and key or line, and exit
with status 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import load_params
from .errors import UserError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    prep = sub.add_parser("prepare", help="write the default task's splits and tokenizer")
    prep.add_argument("--out", type=Path, default=Path("data/prepared"))
    sft = sub.add_parser("sft", help="supervised fine-tuning on demonstrations")
    sft.add_argument("--data", type=Path, default=Path("data/prepared"))
    sft.add_argument("--out", type=Path, default=Path("outputs/sft"))
    reward = sub.add_parser("reward", help="reward model on preference pairs")
    reward.add_argument("--data", type=Path, default=Path("data/prepared"))
    reward.add_argument("--sft", type=Path, default=Path("outputs/sft/model"))
    reward.add_argument("--out", type=Path, default=Path("outputs/reward"))
    ppo = sub.add_parser("ppo", help="PPO against the reward model")
    ppo.add_argument("--data", type=Path, default=Path("data/prepared"))
    ppo.add_argument("--sft", type=Path, default=Path("outputs/sft/model"))
    ppo.add_argument("--reward", type=Path, default=Path("outputs/reward/model"))
    ppo.add_argument("--out", type=Path, default=Path("outputs/ppo"))
    ev = sub.add_parser("evaluate", help="SFT, best-of-n and PPO on the held-out prompts")
    ev.add_argument("--data", type=Path, default=Path("data/prepared"))
    ev.add_argument("--sft", type=Path, default=Path("outputs/sft/model"))
    ev.add_argument("--reward", type=Path, default=Path("outputs/reward/model"))
    ev.add_argument("--ppo", type=Path, default=Path("outputs/ppo/model"))
    ev.add_argument("--out", type=Path, default=Path("outputs/evaluate"))
    frontier = sub.add_parser("frontier", help="plot gold and RM score against KL across DVC experiments")
    frontier.add_argument("--out", type=Path, default=Path("outputs/frontier.png"))
    check = sub.add_parser("check", help="validate the params file and exit")
    for p in (prep, sft, reward, ppo, ev, check):
        p.add_argument("--params", type=Path, default=Path("params.yaml"))
        p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.stage == "frontier":
        from . import frontier
        frontier.main(args.out)
        return 0
    try:
        params = load_params(args.params)
        if args.stage == "prepare":
            from . import prepare
            stats = prepare.run(params.data, args.out)
            print(f"prepare: wrote {args.out} (noise ceiling on held-out pairs "
                  f"{stats['noise_ceiling']['pairs_eval']:.3f})")
        elif args.stage == "sft":
            from . import sft
            metrics = sft.run(params, args.data, args.out, progress=not args.no_progress)
            print(f"sft: wrote {args.out}; " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()
                                                       if k.startswith("eval/")))
        elif args.stage == "reward":
            from . import reward
            metrics = reward.run(params, args.data, args.sft, args.out, progress=not args.no_progress)
            print(f"reward: wrote {args.out}; " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()
                                                          if k.startswith("eval/")))
        elif args.stage == "ppo":
            from .ppo import stage
            metrics = stage.run(params, args.data, args.sft, args.reward, args.out, progress=not args.no_progress)
            print(f"ppo: wrote {args.out}; " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()
                                                       if k.startswith("eval/")))
        elif args.stage == "evaluate":
            from . import evaluate
            metrics = evaluate.run(params, args.data, args.sft, args.reward, args.ppo, args.out)
            print(f"evaluate: wrote {args.out}; report: {args.out / 'report.md'}")
            for key in ("sft/gold", "best_of_n/gold", "ppo/gold", "win_rate/ppo_vs_sft_gold"):
                if key in metrics:
                    print(f"  {key} = {metrics[key]:.3f}")
        else:
            print(f"{args.params}: ok")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
