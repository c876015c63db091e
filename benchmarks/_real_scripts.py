"""Advice on real public training scripts (benchmarks/advice_wild.py --real-scripts): the loops that
fetch their own batches and the warm-up cases, each under ``gpuwatch -- python ...`` with a cause
injected, the finding's change applied to the script and the run repeated.

The scripts are tests/real_scripts/ (nanoGPT's train.py, PyTorch's word_language_model and DDP
tutorial, Hugging Face's run_clm_no_trainer.py, Lightning's autoencoder, in their own shapes); the
warm-up cases are in-process loops whose first steps are slow (torch's own, and a compilation of
0.3 s a step for the first 4) beside a checkpoint pause every 25 steps. Per row: the rules fired, the
cause against the injected one, the finding's ``.code`` run as pasted (in the script's namespace
where it names the script's objects, else as comments), and where the change applies to the script,
the rate of the changed script against the original's (steps/s over their loops, same host, run
one after the other) beside the gain the finding expected.
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import test_real_scripts as rs

import gpuwidget

from support import burn_cpu

LOOP_RULES = rs.LOOP_RULES


def _top(run: Any, rules: set[str]) -> Any:
    return next((f for f in run.findings if f.rule in rules), None)


def _code_runs(code: str, namespace: dict[str, Any] | None = None) -> str:
    try:
        exec(code, namespace if namespace is not None else {})
    except Exception as exc:  # noqa: BLE001 - the row records it
        return f"{type(exc).__name__}: {exc}"
    prefetcher = (namespace or {}).get("get_batch")
    if hasattr(prefetcher, "close"):
        prefetcher.close()
    return "ok"


def _row(case: str, run: Any, expected: str | None, code: str = "-", gain: str = "-") -> dict[str, Any]:
    rules = [f.rule for f in run.findings]
    named = expected in rules if expected else not [f for f in run.findings
                                                    if f.rule in LOOP_RULES and f.severity == "critical"]
    return {"case": case, "steps": run.summary.get("steps"), "rules": rules, "expected": expected or "none critical",
            "right": named, "code": code, "gain": gain, "warmup_steps": run.summary.get("warmup_steps")}


def _gain(original: Any, changed: Any, finding: Any) -> str:
    return f"{finding.expected_speedup:.2f} / {rs.steps_per_s(changed) / rs.steps_per_s(original):.2f}"


def _script_namespace(script: Path, *args: str) -> dict[str, Any]:
    """The script's names after it ran (unwatched), as a user's kernel would hold them after %run."""
    argv, sys.argv = sys.argv, [str(script), *args]
    try:
        return runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv


def nanogpt(tmp: Path) -> list[dict[str, Any]]:
    args = rs.nanogpt_args(tmp, storage_latency=0.008)
    run, _ = rs.gpuwatch(tmp, *rs.python("nanogpt_train.py", *args))
    found = _top(run, {"loop-waits"})
    rows = [_row("nanoGPT train.py, get_batch on slow storage (no DataLoader)", run, "loop-waits")]
    if found is not None:
        patched = rs.pasted_after(rs.NANOGPT, tmp / "nanogpt_prefetched.py", "get_batch", found.code)
        fixed, _ = rs.gpuwatch(tmp, sys.executable, str(patched), *args)
        rows[0].update(code=_code_runs(found.code, _script_namespace(rs.NANOGPT, *rs.nanogpt_args(tmp))),
                       gain=_gain(run, fixed, found))
    steady, _ = rs.gpuwatch(tmp, *rs.python("nanogpt_train.py", *rs.nanogpt_args(tmp, max_iters=150)))
    rows.append(_row("nanoGPT train.py, steady", steady, None))
    evaluating, _ = rs.gpuwatch(tmp, *rs.python("nanogpt_train.py", *rs.nanogpt_args(
        tmp, max_iters=150, eval_interval=15, eval_iters=60)))
    stall = _top(evaluating, {"periodic-stall"})
    rows.append(_row("nanoGPT train.py, estimate_loss every 15 iterations", evaluating, "periodic-stall",
                     code=_code_runs(stall.code) if stall else "-"))
    return rows


def word_language_model(tmp: Path) -> list[dict[str, Any]]:
    args = rs.wlm_args(tmp, "--read-latency", "0.006")
    run, _ = rs.gpuwatch(tmp, *rs.python("word_language_model.py", *args))
    found = _top(run, {"loop-waits"})
    row = _row("word_language_model, get_batch(source, i) from a slow volume (no DataLoader)", run, "loop-waits")
    if found is not None:
        patched = rs.pasted_after(rs.WLM, tmp / "wlm_prefetched.py", "get_batch", found.code)
        fixed, _ = rs.gpuwatch(tmp, sys.executable, str(patched), *args)
        namespace = _script_namespace(rs.WLM, *rs.wlm_args(tmp, "--epochs", "1"))
        row.update(code=_code_runs(found.code, namespace), gain=_gain(run, fixed, found))
    manual = [arg for arg in args if arg != "--use-optimizer"]
    sgd, _ = rs.gpuwatch(tmp, *rs.python("word_language_model.py", *manual))
    sgd_row = _row("word_language_model, its manual SGD update (no optimizer), get_batch slow", sgd, "loop-waits")
    found = _top(sgd, {"loop-waits"})
    if found is not None:
        patched = rs.pasted_after(rs.WLM, tmp / "wlm_sgd_prefetched.py", "get_batch", found.code)
        fixed, _ = rs.gpuwatch(tmp, sys.executable, str(patched), *manual)
        namespace = _script_namespace(rs.WLM, *[arg for arg in rs.wlm_args(tmp, "--epochs", "1")
                                                if arg != "--use-optimizer"])
        sgd_row.update(code=_code_runs(found.code, namespace), gain=_gain(sgd, fixed, found))
    return [row, sgd_row]


def hf_no_trainer(tmp: Path) -> list[dict[str, Any]]:
    run, _ = rs.gpuwatch(tmp, *rs.python("run_clm_no_trainer.py", *rs.HF_ARGS, "--use_slow_tokenizer"))
    found = _top(run, rs.LOADER_RULES)
    row = _row("HF run_clm_no_trainer, tokenizing in collate_fn, num_workers=0", run,
               found.rule if found is not None and found.rule != "io-bound" else "dataloader-starved")
    if found is not None:
        row["code"] = _code_runs(found.code)
    return [row]


def lightning(tmp: Path) -> list[dict[str, Any]]:
    args = [*rs.LIGHTNING_ARGS, "--default_root_dir", str(tmp / "logs")]
    run, _ = rs.gpuwatch(tmp, *rs.python("lightning_autoencoder.py", *args, "--sample_every_n_steps", "10"))
    stall = _top(run, {"periodic-stall"})
    row = _row("Lightning autoencoder, image sampling every 10 steps", run, "periodic-stall")
    if stall is not None:
        fixed, _ = rs.gpuwatch(tmp, *rs.python("lightning_autoencoder.py", *args, "--sample_every_n_steps",
                                               str(stall.change["every_n_steps"])))
        row.update(code=_code_runs(stall.code), gain=_gain(run, fixed, stall))
    return [row]


def ddp(tmp: Path) -> list[dict[str, Any]]:
    run, _ = rs.gpuwatch(tmp, *rs.torchrun(tmp, "--straggler", "1", "--delay", "0.01"))
    found = _top(run, {"rank-straggler"})
    row = _row("torchrun DDP tutorial, rank 1 10 ms slower a batch", run, "rank-straggler")
    steady, _ = rs.gpuwatch(tmp, *rs.torchrun(tmp))
    if found is not None:
        row.update(code=_code_runs(found.code), gain=_gain(run, steady, found))
    return [row, _row("torchrun DDP tutorial, symmetric ranks", steady, None)]


def _warmup_loop(first_steps_s: float, first_steps: int, pause_every: int) -> Any:
    """In-process: an in-memory TensorDataset loop (1.5 ms a step), its first steps slower inside the
    model's forward (a compilation), a 0.3 s checkpoint pause every ``pause_every`` steps (0: none)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    class Compiling(torch.nn.Module):
        """Its first training forwards take longer, inside the forward, as torch.compile's compilation does."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
            self.compiling = first_steps

        def forward(self, x: Any) -> Any:
            if self.compiling > 0 and self.training:
                self.compiling -= 1
                time.sleep(first_steps_s)
            return self.net(x)

    loader = DataLoader(TensorDataset(torch.randn(1200, 32), torch.randint(0, 4, (1200,))), batch_size=8)
    model = Compiling()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gpuwidget.watch(display=False, interval=0.05) as run:
        for step, (x, y) in enumerate(loader):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            burn_cpu(0.0015)
            if pause_every and step % pause_every == pause_every - 1:
                torch.save(model.state_dict(), os.devnull)
                time.sleep(0.3)  # the checkpoint's write to a slow volume
    return run


def warmup(tmp: Path) -> list[dict[str, Any]]:
    cases: list[tuple[str, Callable[[], Any], str | None]] = [
        ("warm-up: torch's first steps, a 0.3 s checkpoint pause every 25 steps",
         lambda: _warmup_loop(0.0, 0, 25), "periodic-stall"),
        ("warm-up: 4 compiling steps of 0.3 s, a 0.3 s pause every 25 steps",
         lambda: _warmup_loop(0.3, 4, 25), "periodic-stall"),
        ("warm-up: 4 compiling steps of 0.3 s, then steady", lambda: _warmup_loop(0.3, 4, 0), None),
    ]
    rows = []
    for name, make, expected in cases:
        run = make()
        found = _top(run, {expected}) if expected else None
        rows.append(_row(name, run, expected, code=_code_runs(found.code) if found else "-"))
    return rows


def run_all(quick: bool) -> list[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="real_scripts"))
    parts = [nanogpt, word_language_model, warmup] if quick else [nanogpt, word_language_model, hf_no_trainer,
                                                                    lightning, ddp, warmup]
    rows: list[dict[str, Any]] = []
    for part in parts:
        folder = tmp / part.__name__
        folder.mkdir()
        for row in part(folder):
            rows.append(row)
            print("  " + " | ".join(format_row(row)), flush=True)
    return rows


def format_row(row: dict[str, Any]) -> list[str]:
    cause = f"{row['expected']} ({'right' if row['right'] else 'WRONG'})"
    warm = "-" if not row.get("warmup_steps") else str(row["warmup_steps"])
    return [row["case"], str(row["steps"]), ", ".join(row["rules"]) or "(none)", cause, warm, row["code"], row["gain"]]


HEADERS = ["case", "steps", "rules fired", "cause", "warm-up steps", ".code", "gain expected / measured"]
