"""The fuzz driver of tests/system/test_bad_inputs.py::test_fuzzed_inputs_keep_the_contract (run in a child
process): mutate one input of a valid tiny run at a time and run `python -m pipeline check --data`
on it in-process, printing one JSON line per case. Usage: fuzz_inputs.py PARAMS DATA SEED N."""

from __future__ import annotations

import contextlib
import io
import json
import random
import resource
import shutil
import sys
import time
from pathlib import Path

from pipeline.__main__ import main

import safetensors.torch  # noqa: E402,F401 - the libraries' own footprint is the baseline of the memory bound
import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401

BASE_KB = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

FILES = ("sft_train.jsonl", "sft_eval.jsonl", "pairs_train.jsonl", "pairs_eval.jsonl", "ppo_prompts.jsonl",
         "eval_prompts.jsonl", "stats.json", "params.yaml")
ODD_VALUES = [None, True, 0, -1, 3.5, "", " ", "x" * 5000, [], {}, [1, "a"], {"role": "user"}, 1e308, -1e308,
              10 ** 30, "\u0000", "Review the film ."]


def swap_value(line: str, rng: random.Random) -> str:
    """A JSON line with one value replaced by a value of another type (or a field dropped or added)."""
    try:
        row = json.loads(line)
    except ValueError:
        return line
    if not isinstance(row, dict) or not row:
        return line
    key = rng.choice(sorted(row))
    action = rng.random()
    if action < 0.7:
        row[key] = rng.choice(ODD_VALUES)
    elif action < 0.85:
        del row[key]
    else:
        row[rng.choice(["margin", "score", key + "_x"])] = rng.choice(ODD_VALUES)
    return json.dumps(row)


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    lines = data.split(b"\n")
    kind = rng.choice(["flip", "truncate", "duplicate", "delete", "swap", "huge", "empty", "garbage"])
    if kind == "flip" and data:
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return kind, bytes(b)
    if kind == "truncate":
        return kind, data[:rng.randrange(len(data) + 1)]
    if kind == "duplicate" and lines:
        i = rng.randrange(len(lines))
        return kind, b"\n".join(lines[:i + 1] + [lines[i]] + lines[i + 1:])
    if kind == "delete" and lines:
        i = rng.randrange(len(lines))
        return kind, b"\n".join(lines[:i] + lines[i + 1:])
    if kind == "swap" and lines:
        i = rng.randrange(len(lines))
        lines[i] = swap_value(lines[i].decode("utf-8", "replace"), rng).encode("utf-8", "surrogatepass")
        return kind, b"\n".join(lines)
    if kind == "huge":
        digits = rng.choice([b"9" * 5000, b"1e400", b"-1e400", b"123456789012345678901234567890"])
        i = data.find(b": ", rng.randrange(len(data) + 1))
        return kind, data[:i + 2] + digits + b"," + data[i + 2:] if i >= 0 else data + digits
    if kind == "empty":
        return kind, b""
    return "garbage", bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))


def run(params: Path, data: Path, seed: int, n: int) -> None:
    rng = random.Random(seed)
    work = Path(data).parent / f"fuzz_{seed}"
    for case in range(n):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(data, work / "data")
        shutil.copy(params, work / "params.yaml")
        name = rng.choice(FILES)
        target = work / "params.yaml" if name == "params.yaml" else work / "data" / name
        kind, content = mutate(target.read_bytes(), rng)
        target.write_bytes(content)
        err, t0 = io.StringIO(), time.perf_counter()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = main(["check", "--params", str(work / "params.yaml"), "--data", str(work / "data")])
        except BaseException as e:   # noqa: BLE001 - anything escaping main breaks the contract
            rc = f"escaped {type(e).__name__}: {str(e)[:300]}"
        print("CASE" + json.dumps({"case": case, "file": name, "mutation": kind, "rc": rc,
                                   "stderr": err.getvalue()[-2000:], "seconds": time.perf_counter() - t0}), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print("GROWTH_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - BASE_KB, flush=True)


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
