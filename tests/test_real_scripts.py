"""Well-known public training scripts, in their own shapes, watched as a user would watch them.

The scripts in ``tests/real_scripts/`` are written in the shape of karpathy/nanoGPT's ``train.py``,
PyTorch's ``word_language_model/main.py`` and ``ddp-tutorial-series/multigpu_torchrun.py``, Hugging
Face's ``run_clm_no_trainer.py`` (accelerate) and Lightning's ``basics/autoencoder.py``; what each
changed for this machine (CPU, gloo, tiny sizes, data made in code) is in its docstring. Every script
runs with a cause injected through an option of its own, under ``gpuwatch -- python ...`` (a child
process the watch reaches through its start-up hook) and under ``%%gpuwatch`` (``%run`` in a cell, the
script's names then in the notebook's namespace). Each check: the steps are the ones the script
itself counted; the injected cause is named by its rule; the finding's ``.code`` runs as pasted in
the script's namespace, and applied to the script (pasted after the definition it names, or the
change made where the script builds what it names) the cause is gone and the loop runs faster.
A steady run of each shape gets no critical finding about its loop.

On this 2-core machine shared with other jobs every script runs on one torch thread
(``OMP_NUM_THREADS=1``; the host's contention is then the host's, and ``cpu-contention`` may be named
beside the injected cause: it is the truth here, and not a finding about the loop).
"""

from __future__ import annotations

import ast
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpuwidget
from gpuwidget import Run
from gpuwidget.advice.rules.dataloader_cpu_bound import batch_builder
from gpuwidget.prefetch import Prefetcher
from gpuwidget.report import run_text

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "real_scripts"
INTERVAL = "0.05"
# Findings about the training loop itself: a steady loop gets none of them as critical. Host
# contention (cpu-contention) and too-short runs (watch-longer) are about the machine and the watch.
LOOP_RULES = {"loop-waits", "periodic-stall", "dataloader-starved", "dataloader-cpu-bound", "io-bound",
              "rank-straggler", "ddp-communication", "small-batch", "launch-bound"}
LOADER_RULES = {"dataloader-starved", "dataloader-cpu-bound", "io-bound"}
# A change applied to the script pays off by at least this much in the same host's conditions (the
# injected waits are 40-70% of the loop: 1.5-3x; the host's load moves a run's rate by +-20%).
MIN_MEASURED_GAIN = 1.15


def script_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def gpuwatch(tmp_path: Path, *command: str, timeout: float = 240) -> tuple[Run, str]:
    """``gpuwatch -- COMMAND`` from ``tmp_path``; the saved Run and the command's output."""
    saved = tmp_path / f"run-{len(list(tmp_path.glob('run-*.json')))}.json"
    result = subprocess.run([sys.executable, "-m", "gpuwidget.cli", "--interval", INTERVAL, "--quiet", "--save",
                             str(saved), "--", *command], cwd=tmp_path, env=script_env(), capture_output=True,
                            text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    return Run.load(saved), result.stdout


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / script), *args]


@pytest.fixture
def cell(ip: Any, capsys: Any, tmp_path: Path, monkeypatch: Any, one_torch_thread: None) -> Iterator[Any]:
    """``cell(script_path, *args)``: ``%%gpuwatch`` over ``%run script args`` from ``tmp_path``; the Run,
    what the script printed, and the notebook's namespace (the script's names are in it)."""
    monkeypatch.chdir(tmp_path)
    for name, value in script_env().items():
        if name != "PYTHONPATH":
            monkeypatch.setenv(name, value)
    before = set(ip.user_ns)

    def run(script: Path | str, *args: str) -> tuple[Run, str, dict[str, Any]]:
        capsys.readouterr()
        result = ip.run_cell(f"%%gpuwatch --quiet --interval {INTERVAL}\n%run {shlex.join([str(script), *args])}")
        assert result.error_in_exec is None, result.error_in_exec
        return gpuwidget.last_run(), capsys.readouterr().out, ip.user_ns

    yield run
    for name in set(ip.user_ns) - before:  # the scripts' names go with the test
        value = ip.user_ns.pop(name)
        if isinstance(value, Prefetcher):
            value.close()


def finding(run: Run, rule: str) -> Any:
    return next((f for f in run.findings if f.rule == rule), None)


def printed_count(output: str, pattern: str) -> int:
    """The number the script printed itself (its own count of steps), from its last line matching ``pattern``."""
    found = re.findall(pattern, output)
    assert found, output[-2000:]
    return int(found[-1])


def no_critical_loop_finding(run: Run, known: frozenset[str] = frozenset()) -> None:
    critical = [f"{f.rule}: {f.title}" for f in run.findings
                if f.severity == "critical" and f.rule in LOOP_RULES - known]
    assert not critical, critical


def pasted_after(source_file: Path, target: Path, function: str, code: str) -> Path:
    """A copy of the script with ``code`` pasted right after the top-level ``def function`` block, as a
    user pastes a finding's code under the definition it names."""
    source = source_file.read_text()
    tree = ast.parse(source)
    node = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function)
    lines = source.splitlines()
    end = node.end_lineno or node.lineno
    target.write_text("\n".join([*lines[:end], "", code, "", *lines[end:]]) + "\n")
    return target


def steps_per_s(run: Run) -> float:
    return float(run.summary["steps"]) / float(run.summary["loop_time_s"])


def assert_prefetcher_code(found: Any, namespace: dict[str, Any], name: str, call: tuple[Any, ...]) -> None:
    """The loop-waits code, run as pasted in the script's namespace, wraps the script's own function."""
    assert found.change == {"prefetch": name}, found.code
    original = namespace[name]
    exec(found.code, namespace)
    wrapped = namespace[name]
    assert isinstance(wrapped, Prefetcher) and wrapped.function is original
    first, second = wrapped(*call), wrapped(*call)  # the second from the call ahead
    assert type(first) is type(second) and len(first) == len(second)
    wrapped.close()
    namespace[name] = original


# ------------------------------------------------------------------ nanoGPT: get_batch reads from slow storage

NANOGPT = SCRIPTS / "nanogpt_train.py"
# Seconds the evaluating nanoGPT run lasts at least: twice the second of steady steps a cause needs.
EVAL_RUN_S = 2.0
STORAGE_LINE = NANOGPT.read_text().splitlines().index(
    "        time.sleep(storage_latency)  # the volume's round trip") + 1


def nanogpt_args(tmp_path: Path, **config: Any) -> list[str]:
    settings = {"out_dir": str(tmp_path / "out"), "max_iters": 100, "log_interval": 1000, **config}
    return [f"--{key}={value}" for key, value in settings.items()]


def test_nanogpt_waiting_on_storage_in_get_batch_is_named_under_gpuwatch(tmp_path):
    run, output = gpuwatch(tmp_path, *python("nanogpt_train.py", *nanogpt_args(tmp_path, storage_latency=0.008)))
    assert run.summary["steps"] == printed_count(output, r"trained (\d+) iterations") == 100
    assert run.summary["step_source"] == "optimizer" and run.ranks[0]["pid"] != os.getpid()
    found = finding(run, "loop-waits")
    assert found is not None, run.workload.get("loop_waits")
    # nanoGPT fetches the next batch between a micro-step's forward and its backward: inside the step.
    assert found.evidence["function"] == "get_batch", found.evidence
    assert found.evidence["at"].endswith(f"nanogpt_train.py, line {STORAGE_LINE}"), found.evidence
    assert found.code.endswith("get_batch = Prefetcher(get_batch)")
    parts = run.summary["time_breakdown"]  # the optimizer's steps split the training process's time
    assert sum(parts.values()) == pytest.approx(run.summary["duration_s"], abs=1e-6)
    assert parts["before_loop_s"] > 0 and parts["compute_s"] == pytest.approx(run.summary["loop_time_s"], rel=0.05)
    assert "training process" in run_text(run)  # "this process" is the script's, not gpuwatch's own


def test_nanogpt_in_a_cell_the_prefetcher_code_runs_as_pasted_and_applied_removes_the_wait(cell, tmp_path):
    run, output, namespace = cell(NANOGPT, *nanogpt_args(tmp_path, storage_latency=0.008))
    assert run.summary["steps"] == namespace["iter_num"] == 100
    found = finding(run, "loop-waits")
    assert found is not None and found.evidence["function"] == "get_batch", run.workload.get("loop_waits")
    assert_prefetcher_code(found, namespace, "get_batch", ("train",))
    patched = pasted_after(NANOGPT, tmp_path / "nanogpt_prefetched.py", "get_batch", found.code)
    fixed, _, namespace = cell(patched, *nanogpt_args(tmp_path, storage_latency=0.008))
    assert isinstance(namespace["get_batch"], Prefetcher) and fixed.summary["steps"] == 100
    assert finding(fixed, "loop-waits") is None, fixed.workload.get("loop_waits")
    gain = steps_per_s(fixed) / steps_per_s(run)
    assert gain >= MIN_MEASURED_GAIN, (gain, found.expected_speedup)
    namespace["get_batch"].close()


def eval_iters_for(step_s: float, iters: int = 150, every: int = 15, target_s: float = EVAL_RUN_S) -> int:
    """The ``eval_iters`` that make a run of ``iters`` steps of ``step_s`` seconds, evaluating every
    ``every`` steps, last ``target_s`` seconds at least: an evaluation runs ``eval_iters`` forward passes
    on each of two splits, a forward pass about a fifth of a training step (0.47 of 2.05 ms, measured)."""
    evaluations = iters // every
    return max(60, math.ceil((target_s - iters * step_s) / (evaluations * 2 * step_s / 5)))


def test_nanogpt_steady_gets_no_critical_loop_finding_and_its_periodic_eval_is_named(cell, tmp_path):
    steady, _, _ = cell(NANOGPT, *nanogpt_args(tmp_path, max_iters=150))
    assert steady.summary["steps"] == 150
    no_critical_loop_finding(steady)
    # Sized from the steady run's own step: on a quiet host (2 ms steps) 60 evaluation batches made a run
    # of 0.88 s, under the second of steady steps a cause needs (advice.evidence): "watch longer".
    evaluating, _, namespace = cell(NANOGPT, *nanogpt_args(tmp_path, max_iters=150, eval_interval=15,
                                                           eval_iters=eval_iters_for(steady.summary["step_time_p50"])))
    stall = finding(evaluating, "periodic-stall")
    assert stall is not None, [f.title for f in evaluating.findings]
    assert stall.evidence["period_steps"] == 15 and stall.change["stall"] == "evaluation", stall.evidence
    assert finding(evaluating, "loop-waits") is None  # one explanation for the evaluation's seconds
    exec(stall.code, dict(namespace))  # defines its helper: runs as pasted beside the script's names


# ------------------------------------------------------------------ word_language_model: slow get_batch(source, i)

WLM = SCRIPTS / "word_language_model.py"
# The shortest slow read the prefetching test injects (seconds), and how long its slow loop runs at least.
MIN_READ_S = 0.003
PREFETCH_LOOP_S = 2.0


def wlm_args(tmp_path: Path, *more: str) -> list[str]:
    return ["--use-optimizer", "--lr", "0.003", "--data", str(tmp_path / "data"), "--save", str(tmp_path / "m.pt"),
            "--log-interval", "1000", *more]


def test_word_language_model_slow_reads_are_named_under_gpuwatch(tmp_path):
    run, output = gpuwatch(tmp_path, *python("word_language_model.py", *wlm_args(tmp_path, "--read-latency", "0.006")))
    assert run.summary["steps"] == printed_count(output, r"trained (\d+) batches") == 204
    found = finding(run, "loop-waits")
    assert found is not None and found.evidence["function"] == "get_batch", run.workload.get("loop_waits")
    assert found.code.endswith("get_batch = Prefetcher(get_batch)")


def test_word_language_model_in_a_cell_prefetching_the_next_rows_pays_off(cell, tmp_path):
    # A read as long as a step computes on this host, timed first in a cell like the others, so that
    # prefetching can hide all of it (up to 2x) whatever the CPU's speed: a fixed 12 ms read beside a
    # fast CPU's 3 ms step would bound the gain at 1.25x. Four LSTM layers make a step's compute a
    # few milliseconds (a read the sampler's ticks can find), and the text is long enough for the loop
    # to run past the evidence gate (advice.evidence: a second of steady steps) with room to spare.
    deeper = ("--nlayers", "4")
    steady, _, namespace = cell(WLM, *wlm_args(tmp_path, *deeper))
    compute_s = steady.summary["step_time_p50"]
    read_s = max(MIN_READ_S, compute_s)
    batches = namespace["batches_trained"]
    words = str(int(12_000 * max(1.0, PREFETCH_LOOP_S / (batches * (read_s + compute_s)))))
    args = wlm_args(tmp_path, *deeper, "--words", words, "--read-latency", f"{read_s:.4f}")
    run, _, namespace = cell(WLM, *args)
    trained = namespace["batches_trained"]
    assert run.summary["steps"] == trained and trained >= batches
    found = finding(run, "loop-waits")
    assert found is not None and found.evidence["function"] == "get_batch"
    assert_prefetcher_code(found, namespace, "get_batch", (namespace["train_data"], 0))
    patched = pasted_after(WLM, tmp_path / "wlm_prefetched.py", "get_batch", found.code)
    fixed, _, namespace = cell(patched, *args)
    assert isinstance(namespace["get_batch"], Prefetcher) and fixed.summary["steps"] == trained
    # get_batch(source, i) is called with i advancing by bptt: the call ahead reads the next rows. A read
    # slower than the step still waits, at train()'s own line: the loop's, never prefetched itself.
    assert steps_per_s(fixed) / steps_per_s(run) >= MIN_MEASURED_GAIN, (compute_s, read_s, words)
    left = finding(fixed, "loop-waits")
    assert left is None or (left.change == {} and "Prefetcher(" not in left.code), left.code
    namespace["get_batch"].close()


def test_word_language_model_with_its_manual_sgd_update_counts_its_steps_and_names_the_slow_reads(tmp_path):
    """The example's default update is ``p.data.add_(p.grad, alpha=-lr)``: no optimizer, and no version
    counter moves (``.data``). The model's parameters change between its training forwards, so each
    forward starts a step (``step_source`` "forward"), and the slow reads are named as with AdamW."""
    args = wlm_args(tmp_path, "--read-latency", "0.006")
    args.remove("--use-optimizer")
    run, output = gpuwatch(tmp_path, *python("word_language_model.py", *args))
    assert run.summary["steps"] == printed_count(output, r"trained (\d+) batches") == 204
    assert run.summary["step_source"] == "forward" and "optimizer_steps" not in run.summary
    assert "no optimizer steps the model" in run.summary["mfu_missing"]
    found = finding(run, "loop-waits")
    assert found is not None and found.evidence["function"] == "get_batch", run.workload.get("loop_waits")
    assert found.code.endswith("get_batch = Prefetcher(get_batch)")


# ------------------------------------------------------------------ HF run_clm_no_trainer: tokenizing in collate_fn

HF = SCRIPTS / "run_clm_no_trainer.py"
# 280 steps: past the evidence gate (a second of steady steps: advice.evidence) on an idle host too, with
# room (6.1 ms steps there: 150 texts, 140 steps, made 0.89 s; 250 texts 1.54 s).
HF_ARGS = ["--num_texts", "300", "--tokenizer_work", "300"]
# In a cell: 400 texts, ~370 steps of ~6 ms waits in the collate_fn (the DataLoader probe times it on one
# next() in 8: dataloader_cpu_bound.batch_builder).
HF_CELL_ARGS = ["--num_texts", "400", "--tokenizer_work", "300"]
# The functions of the script's collate path: its collate_fn and the slow tokenizer it calls.
COLLATE_PATH = {"collate_fn", "ByteTokenizer.__call__", "ByteTokenizer.__call__.<genexpr>"}


def loader_builders(run: Run) -> list[str]:
    """The functions the loop's thread was found in inside the loader's next(), but the loop's own."""
    return [wait["function"] for wait in run.workload["loop_waits"]
            if wait["in_loader"] >= 0.5 and not wait.get("in_loop")]


def test_hf_no_trainer_tokenizing_in_the_collate_fn_is_named_under_gpuwatch(tmp_path):
    run, output = gpuwatch(tmp_path, *python("run_clm_no_trainer.py", *HF_ARGS, "--use_slow_tokenizer"))
    assert run.summary["steps"] == printed_count(output, r"completed (\d+) optimizer steps")
    assert run.summary["step_source"] == "dataloader" and run.summary["data_wait_fraction"] >= 0.15
    found = next((f for f in run.findings if f.rule in LOADER_RULES), None)
    assert found is not None, [f.title for f in run.findings]
    assert found.rule != "io-bound"  # nothing sleeps or reads storage: the collate_fn computes
    if found.rule == "dataloader-cpu-bound":  # the host's cores are busy: the batches must get cheaper
        assert any(f"{name}()" in found.code for name in COLLATE_PATH), found.code
        assert "__getitem__" not in found.code
    exec(found.code, {})  # the loader is main()'s local: the code says where, and runs as pasted


def train_loader(run: Run) -> Any:
    """The loader facts of the loader that fed the optimizer steps."""
    return max(run.workload["loaders"], key=lambda loader: loader.get("steps_fed") or 0)


def test_hf_no_trainer_in_a_cell_its_loader_change_applied_where_the_script_builds_it_pays_off(cell, tmp_path):
    run, output, _ = cell(HF, *HF_CELL_ARGS, "--use_slow_tokenizer")
    assert run.summary["steps"] == printed_count(output, r"completed (\d+) optimizer steps")
    found = next((f for f in run.findings if f.rule in LOADER_RULES), None)
    assert found is not None, [f.title for f in run.findings]
    # The loop's thread builds the batches: in the stack samples inside next(), or, where those were read
    # after the collate_fn's ~6 ms of Python had ended (a read waits for the GIL), in the probe's timing.
    builder = batch_builder(run.workload, train_loader(run))
    assert builder is not None and builder["function"] in COLLATE_PATH, (run.workload["loop_waits"],
                                                                          train_loader(run).get("collate_share"))
    assert set(loader_builders(run)) <= COLLATE_PATH, run.workload["loop_waits"]
    if found.change.get("num_workers"):
        # Made where the script builds its train loader (the finding says where), the same run.
        source = HF.read_text()
        call = "train_dataset, shuffle=True, collate_fn=collate_fn, batch_size=args.per_device_train_batch_size"
        assert call in source
        patched = tmp_path / "hf_workers.py"
        patched.write_text(source.replace(call, f"{call}, num_workers={found.change['num_workers']}"))
        fixed, _, _ = cell(patched, *HF_CELL_ARGS, "--use_slow_tokenizer")
        # The workers build the batches now: the loop's own thread no longer does (its stack samples
        # inside next() find no collate_fn), and it waits less for them (how much less is the host's
        # to say: its two cores are shared with the workers and the other jobs).
        assert not set(loader_builders(fixed)) & COLLATE_PATH, fixed.workload["loop_waits"]
        assert train_loader(fixed).get("collate_share") is None  # nor is it timed there
        assert fixed.summary["data_wait_fraction"] < run.summary["data_wait_fraction"]
    else:
        # Cheaper batches: the script's own path that tokenizes the texts once, ahead of training.
        fixed, _, _ = cell(HF, *HF_CELL_ARGS)
        assert fixed.summary["data_wait_fraction"] < 0.5 * run.summary["data_wait_fraction"]
    assert not [f for f in fixed.findings if f.rule in LOADER_RULES and f.severity == "critical"]
    no_critical_loop_finding(fixed)


# ------------------------------------------------------------------ Lightning: a sampling callback every N steps

LIGHTNING = SCRIPTS / "lightning_autoencoder.py"
LIGHTNING_ARGS = ["--images", "3200", "--num_samples", "20000"]  # 176 steps, 17 stalls: past the evidence gate


def test_lightning_sampling_every_10_steps_is_a_periodic_stall_under_gpuwatch(tmp_path):
    run, output = gpuwatch(tmp_path, *python("lightning_autoencoder.py", *LIGHTNING_ARGS, "--sample_every_n_steps",
                                             "10", "--default_root_dir", str(tmp_path / "logs")))
    assert run.summary["steps"] == printed_count(output, r"trained (\d+) steps") == 176
    stall = finding(run, "periodic-stall")
    assert stall is not None and stall.evidence["period_steps"] == 10, [f.title for f in run.findings]
    assert stall.change["stall"] == "evaluation"  # the stack samples: sampling from the decoder
    assert finding(run, "loop-waits") is None  # its seconds are the stall's: one explanation


def test_lightning_in_a_cell_sampling_less_often_as_advised_removes_the_stall(cell, tmp_path):
    run, output, namespace = cell(LIGHTNING, *LIGHTNING_ARGS, "--sample_every_n_steps", "10",
                                  "--default_root_dir", str(tmp_path / "logs"))
    assert run.summary["steps"] == printed_count(output, r"trained (\d+) steps") == 176
    stall = finding(run, "periodic-stall")
    assert stall is not None and stall.evidence["period_steps"] == 10
    exec(stall.code, dict(namespace))  # its helper, defined beside the script's names
    every = stall.change["every_n_steps"]  # applied as the callback's own setting
    fixed, _, _ = cell(LIGHTNING, *LIGHTNING_ARGS, "--sample_every_n_steps", str(every),
                       "--default_root_dir", str(tmp_path / "logs2"))
    assert finding(fixed, "periodic-stall") is None or finding(fixed, "periodic-stall").severity != "critical"
    assert steps_per_s(fixed) / steps_per_s(run) >= MIN_MEASURED_GAIN


# ------------------------------------------------------------------ torchrun DDP tutorial: one rank straggles

def torchrun(tmp_path: Path, *args: str) -> list[str]:
    launcher = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    return [launcher, "--standalone", "--nproc_per_node=2", str(SCRIPTS / "multigpu_torchrun.py"), "4", "10",
            "--size", "768", "--snapshot_path", str(tmp_path / f"snapshot-{len(list(tmp_path.iterdir()))}.pt"),
            *args]


def rank_evidence(run: Run) -> str:
    """What rank-straggler reads of each rank (its steps, DDP's figures, its stack's top wait) and the run's
    findings, one a line: a string, which pytest prints whole (an object's repr is cut at 240 characters)."""
    from gpuwidget.advice.rules._ranks import ddp_timings, median, ranks, step_series
    from gpuwidget.advice.rules.rank_straggler import stalled_s

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f}"

    lines = [f"rank {rank['rank']}: step {ms(median(series[0])) if (series := step_series(rank)) else None} ms, "
             + ", ".join(f"{t.which}{'' if t in ddp_timings(rank) else ' (untypical)'} {ms(t.compute_s)}"
                         f"+{ms(t.exposed_s)}" for t in ddp_timings(rank, typical_only=False))
             + f", stalled {ms(stalled_s(rank))}, run delay {(rank.get('host') or {}).get('run_delay_fraction')}"
             for rank in ranks(run.workload)]
    return "\n".join([*lines, *(f"finding {f.rule}: {f.title}" for f in run.findings)])


def assert_rank_1_straggles(run: Run, output: str) -> Any:
    trained = [int(count) for count in re.findall(r"\[rank\d\] trained (\d+) steps", output)]
    assert trained == [192, 192], output[-2000:]
    assert sorted(rank["steps"] for rank in run.ranks) == [192, 192] and run.summary["steps"] == 192
    straggler = finding(run, "rank-straggler")
    assert straggler is not None, rank_evidence(run)
    assert straggler.evidence["straggler"] == 1, straggler.evidence
    # Measured: the others were seen waiting for it in the all-reduce; the gain is bounded by that.
    assert straggler.evidence["others_waited_ms"] >= straggler.evidence["extra_ms"] > 5.0
    assert "_run_epoch()" in straggler.title  # where its stack samples put the extra time
    assert finding(run, "loop-waits") is None  # the straggler's wait has one explanation
    exec(straggler.code, {})
    return straggler


# The straggler's extra time per step. rank-straggler compares each rank's own time outside the all-reduce in
# DDP's average and in its latest figure, one step's: on a loaded host a rank waits for a core 25-33 % of
# the time, and in that one step the straggler can itself wait in the all-reduce for the other
# (descheduled) rank. With 10 ms its lead in that figure came down to 3.8 ms against a floor of 2.6 (1 of 6
# runs beside three CPU-bound neighbours), and fresh-check run 93 (one neighbour, a slow host) read none;
# 20 ms keeps it clear of what one step's noise takes away (18.1-19.7 ms against 2.2-4.2 in 5 of 5 runs
# beside four).
STRAGGLER_DELAY = "0.02"


def test_ddp_straggling_rank_is_named_under_gpuwatch_and_a_steady_job_has_no_straggler(tmp_path):
    run, output = gpuwatch(tmp_path, *torchrun(tmp_path, "--straggler", "1", "--delay", STRAGGLER_DELAY))
    assert_rank_1_straggles(run, output)
    steady, _ = gpuwatch(tmp_path, *torchrun(tmp_path))
    assert finding(steady, "rank-straggler") is None, rank_evidence(steady)
    # ddp-communication on two gloo ranks sharing this host's 2 loaded cores still names their waits for
    # each other (for a core) as the all-reduce's, critical in some runs: issue 25's "DDP causes are
    # stable" work, not this suite's; every other loop rule must stay quiet.
    no_critical_loop_finding(steady, known=frozenset({"ddp-communication"}))
    assert steps_per_s(steady) / steps_per_s(run) >= MIN_MEASURED_GAIN


def test_ddp_job_started_from_a_cell_names_its_straggler(ip, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ip.user_ns["_job"] = torchrun(tmp_path, "--straggler", "1", "--delay", STRAGGLER_DELAY)
    ip.user_ns["_extra"] = {key: value for key, value in script_env().items() if os.environ.get(key) != value}
    # The environment is read inside the cell: the watch exports its children's variables as it starts.
    result = ip.run_cell(f"%%gpuwatch --quiet --interval {INTERVAL}\nimport os, subprocess\n"
                         "_done = subprocess.run(_job, env={**os.environ, **_extra}, capture_output=True, text=True,"
                         " timeout=240)")
    assert result.error_in_exec is None
    done = ip.user_ns.pop("_done")
    ip.user_ns.pop("_job"), ip.user_ns.pop("_extra")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_rank_1_straggles(gpuwidget.last_run(), done.stdout)
