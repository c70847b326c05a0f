"""Write tests/helpers/fake_vllm/vllm_api.json: the parts of vLLM's API that pipeline/models/vllm_engine.py uses,
read from the source of the pinned wheel (downloaded, never installed: vLLM needs CUDA).

    .venv/bin/python scripts/vllm_api.py                 # download vllm==PIN
    .venv/bin/python scripts/vllm_api.py --wheel PATH    # or read a wheel already here
    .venv/bin/python scripts/vllm_api.py --check         # exit 1 when the committed extract differs

The tests' fake `vllm` (tests/helpers/fake_vllm/vllm/) accepts exactly what this extract lists and a test checks
the fake against it, so a vLLM upgrade that renames or drops something we call fails a test once
the extract is rewritten, without a download in CI. Read with `ast` only: nothing of vLLM runs.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "helpers" / "fake_vllm" / "vllm_api.json"
# The newest vLLM that installs from PyPI (0.34.0's x86_64 wheel needs a flashinfer-python that PyPI
# lacks). It needs torch 2.14.0 and transformers < 5.21: the vllm extra's own environment,
# requirements-vllm.lock (docs/guide/rollout-engines.md). pyproject.toml's extra pins the same release.
PIN = "0.33.0"

# (file in the wheel, class, what to read): "init"/method names give their parameters; "fields"
# the class's annotated attributes (a dataclass, a msgspec Struct, a TypedDict).
WANTED = [
    ("vllm/entrypoints/llm.py", "LLM", ["__init__", "generate", "sleep", "wake_up", "apply_model"]),
    ("vllm/engine/arg_utils.py", "EngineArgs", "fields"),          # LLM(**kwargs) become these
    ("vllm/sampling_params.py", "SamplingParams", "fields"),
    ("vllm/inputs/llm.py", "TokensPrompt", "fields"),
    ("vllm/outputs.py", "RequestOutput", ["__init__"]),
    ("vllm/outputs.py", "CompletionOutput", "fields"),
    ("vllm/logprobs.py", "Logprob", "fields"),
    ("vllm/model_executor/models/llama.py", "LlamaForCausalLM", ["load_weights"]),
]
LITERALS = [("vllm/config/model.py", "LogprobsMode")]
EXPORTS = ["LLM", "SamplingParams", "TokensPrompt"]   # `from vllm import ...` names we use


def parameters(fn: ast.FunctionDef) -> list[dict]:
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, default in zip(positional, defaults):
        if arg.arg != "self":
            out.append({"name": arg.arg, "kind": "positional", "default": default is not None})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "var_positional", "default": True})
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append({"name": arg.arg, "kind": "keyword_only", "default": default is not None})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "var_keyword", "default": True})
    return out


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise SystemExit(f"vllm_api: class {name} not found")


def fields(cls: ast.ClassDef) -> list[str]:
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and not n.target.id.startswith("_")]


def literal(tree: ast.Module, name: str) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return [c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    raise SystemExit(f"vllm_api: {name} not found")


def extract(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        src = {name: z.read(name).decode() for name in {w[0] for w in WANTED} | {f for f, _ in LITERALS}
               | {"vllm/__init__.py"}}
    version = re.search(r"vllm-([^-]+)-", wheel.name).group(1)
    api: dict = {"version": version, "classes": {}, "literals": {}}
    for path, cls_name, what in WANTED:
        cls = find_class(ast.parse(src[path]), cls_name)
        if what == "fields":
            api["classes"][cls_name] = {"file": path, "fields": fields(cls)}
        else:
            methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
            missing = [m for m in what if m not in methods]
            if missing:
                raise SystemExit(f"vllm_api: {cls_name} has no {', '.join(missing)} in {path}")
            api["classes"][cls_name] = {"file": path, "methods": {m: parameters(methods[m]) for m in what}}
    for path, name in LITERALS:
        api["literals"][name] = literal(ast.parse(src[path]), name)
    init = src["vllm/__init__.py"]
    api["exports"] = [name for name in EXPORTS if re.search(rf'"{name}"\s*:', init)]
    return api


def download(version: str, folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", f"vllm=={version}", "--no-deps", "--only-binary",
                    ":all:", "-d", str(folder)], check=True)
    return next(folder.glob("vllm-*.whl"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="a vllm wheel already downloaded")
    ap.add_argument("--check", action="store_true", help="compare with the committed extract instead of writing it")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download(PIN, Path(tmp))
        text = json.dumps(extract(wheel), indent=1) + "\n"
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print(f"vllm_api: {OUT.relative_to(ROOT)} {'matches' if same else 'differs from'} {wheel.name}")
        return 0 if same else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = OUT.with_suffix(".json.tmp")
    tmp_out.write_text(text)
    tmp_out.replace(OUT)
    print(f"vllm_api: wrote {OUT.relative_to(ROOT)} from {wheel.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
