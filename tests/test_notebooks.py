"""The tutorial notebooks: saved clean, and each one runs headless on the CPU and shows what it teaches.

Every notebook runs in a real kernel (nbclient) in a temporary working directory, so the files it
writes (runs/, tutorial_data.py) never land in the repository. What a notebook teaches is
checked in its executed outputs: the rule ids in the panels that watched cells leave behind
(their text/plain and text/html), or the CPU-side facts the notebook prints.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.notebooks
# The notebooks whose checks judge no time (panels shown, files written, figures printed in their
# format) are ``untimed``: make test runs them in the parallel pass, each in its own kernel and
# temporary folder. 02, 04, 05 and 07 name causes from timings: alone, in the serial pass.

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
EXPECTED = [
    "01-quickstart.ipynb",
    "02-data-starvation.ipynb",
    "03-batch-size-and-precision.ipynb",
    "04-launch-overhead.ipynb",
    "05-stalls.ipynb",
    "06-exporting-runs.ipynb",
    "07-multi-process.ipynb",
]
LOADER_RULES = {"dataloader-starved", "dataloader-cpu-bound", "io-bound"}
# Each notebook runs in well under two minutes on a 2-core CPU; a cell never takes this long.
CELL_TIMEOUT = 180
# A watched cell's saved outputs (its panel; nbclient also saves its closed widgets' state).
MAX_GROWTH_PER_PANEL_CELL = 100_000


def execute(name: str, workdir: Path):
    """Run the notebook top to bottom in a fresh python3 kernel; a failing cell raises."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors, [f"{o.ename}: {o.evalue}" for o in errors]
    # Saved small: no BokehJS inline (1.3 MB) and no widget view stays behind, only the panels.
    showing = sum(1 for c in nb.cells if c.cell_type == "code" and panels(c))
    grown = len(nbformat.writes(nb)) - (NOTEBOOKS / name).stat().st_size
    assert grown < MAX_GROWTH_PER_PANEL_CELL * max(showing, 1), (name, grown, showing)
    return nb


def cell(nb, cell_id: str):
    return next(c for c in nb.cells if c.get("id") == cell_id)


def panels(code_cell) -> list[tuple[str, str]]:
    """(text/plain, text/html) of each gpuwidget panel a cell's outputs hold."""
    found = []
    for output in code_cell.outputs:
        data = output.get("data") or {}
        html = data.get("text/html", "")
        if "gpuwidget-run" in html:
            found.append((data.get("text/plain", ""), html))
    return found


def panel_rules(code_cell) -> set[str]:
    """Rule ids a cell's panel names, in both its plain text and its HTML."""
    (panel,) = panels(code_cell)
    text, html = panel
    # A finding's title line ends with its rule id, then the machine-level label where it has one.
    ids = set(re.findall(r"\(([a-z0-9]+(?:-[a-z0-9]+)+)\)(?: \[the machine, not your code\])?$", text, flags=re.M))
    return {rule for rule in ids if rule in html}


def printed(code_cell) -> str:
    """Everything a cell printed or displayed as text. Stream outputs are joined as they were
    written: the kernel splits one print() across outputs wherever its flush timer fell."""
    parts = []
    for output in code_cell.outputs:
        if output.output_type == "stream":
            if parts and parts[-1][0] == output.name:
                parts[-1] = (output.name, parts[-1][1] + output.text)
            else:
                parts.append((output.name, output.text))
        elif "data" in output:
            parts.append(("data", output.data.get("text/plain", "")))
    return "\n".join(text for _, text in parts)


# ---------------------------------------------------------------- saved state


@pytest.mark.untimed
def test_every_tutorial_is_there_and_saved_without_outputs():
    found = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert set(EXPECTED) <= set(found), f"missing: {set(EXPECTED) - set(found)}"
    for name in found:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3", name
        ids = [c.get("id") for c in nb.cells]
        assert all(ids) and len(set(ids)) == len(ids), f"{name}: every cell needs its own id"
        first_code = next(c for c in nb.cells if c.cell_type == "code")
        assert first_code.source.strip() == "%load_ext gpuwidget", name
        for c in nb.cells:
            if c.cell_type == "code":
                assert c.outputs == [], f"{name}, cell {c.id}: saved with outputs"
                assert c.execution_count is None, f"{name}, cell {c.id}: saved with an execution count"


# ---------------------------------------------------------------- executed


@pytest.mark.untimed
def test_01_quickstart_shows_the_panel_and_saves_and_compares_runs(tmp_path):
    nb = execute("01-quickstart.ipynb", tmp_path)
    ((text, html),) = panels(cell(nb, "watch-first"))
    assert "finished" in text and "samples/s" in text
    assert "no GPU found" in text or "kernel running (nvidia-smi)" in text or "SM active" in text
    assert len(panels(cell(nb, "watch-second"))) == 1
    for suffix in ("json", "html", "csv"):
        assert (tmp_path / "runs" / f"first.{suffix}").stat().st_size > 0
    assert "same samples/s: True" in printed(cell(nb, "save"))
    assert "measured speedup:" in printed(cell(nb, "compare"))


def browser_runs_02() -> bool:
    """tests/ui/test_tutorials.py runs tutorial 02 in JupyterLab and Chromium and checks there what
    :func:`check_02` checks: where it can, that is the one run of 02 (30 s of one core's work fewer)."""
    from ui.conftest import CHROMIUM  # where the browser tests find Chromium

    return Path(CHROMIUM).exists() and importlib.util.find_spec("playwright") is not None


def test_02_data_starvation_names_the_starved_loader_and_the_storage_wait(tmp_path):
    if browser_runs_02():
        pytest.skip("tutorial 02 runs in the browser, where tests/ui/test_tutorials.py checks this of it")
    check_02(execute("02-data-starvation.ipynb", tmp_path))


def check_02(nb) -> None:
    """What tutorial 02 teaches, in its executed outputs (headless here, or in the browser)."""
    starved = cell(nb, "watch-starved")
    rules = panel_rules(starved)
    if "dataloader-cpu-bound" in rules:
        # The loop builds batches on one core; the host CPU (all cores) can only reach the
        # saturation threshold when other programs load the machine meanwhile (other test
        # suites on a shared 2-core box): then that is the right answer for this machine.
        ((text, _),) = panels(starved)
        # (cpus_busy_percent where the CPUs this process may use say more than the host total)
        host = re.search(r"cpus_busy_percent=([\d.]+)", text) or re.search(r"host_cpu_percent=([\d.]+)", text)
        assert host and float(host.group(1)) >= 85, text
    else:
        assert "dataloader-starved" in rules
    # Storage stays storage on a busy host; contention from other programs, when the panel
    # shows it, is what the text beside it reports (02's text and findings agree under load).
    io_rules = panel_rules(cell(nb, "watch-io"))
    assert "io-bound" in io_rules and "dataloader-cpu-bound" not in io_rules
    assert ("cpu-contention" in rules) == ("cpu-contention:" in printed(cell(nb, "starved-finding")))
    assert ("cpu-contention" in io_rules) == ("cpu-contention too" in printed(cell(nb, "io-apply")))
    # The change was applied and measured, for both causes.
    assert "measured speedup:" in printed(cell(nb, "speedup"))
    assert "measured speedup:" in printed(cell(nb, "io-speedup"))
    assert "workers  samples/s" in printed(cell(nb, "sweep"))


@pytest.mark.untimed
def test_03_precision_shows_what_the_model_probe_sees_under_cpu_autocast(tmp_path):
    nb = execute("03-batch-size-and-precision.ipynb", tmp_path)
    assert "'autocast': {'enabled': False" in printed(cell(nb, "fp32-facts"))
    assert printed(cell(nb, "bf16-facts")) == "{'enabled': True, 'dtype': 'bfloat16', 'device_type': 'cpu'}"
    assert "recorded float32_matmul_precision: high" in printed(cell(nb, "tf32"))
    sweep = printed(cell(nb, "batch-sweep"))
    assert re.search(r"batch 512 trains [\d.]+x as many samples per second as batch 8", sweep), sweep
    assert "GPU rules need GPU measurements" in printed(cell(nb, "gpu-findings"))
    probe = printed(cell(nb, "batch-probe"))
    assert re.search(r"On cpu: batch \d+ is where doubling stops paying", probe), probe
    assert "samples/s" in probe and "recommended" in probe


def test_04_launch_overhead_shows_samples_per_second_growing_with_the_batch(tmp_path):
    nb = execute("04-launch-overhead.ipynb", tmp_path)
    match = re.search(r"batch 256 processes (\d+)x more samples per second than batch 4", printed(cell(nb, "sweep")))
    assert match and int(match.group(1)) >= 2, printed(cell(nb, "sweep"))
    assert "% of a core" in printed(cell(nb, "small-read"))
    assert "launch-bound needs the GPU's busy figure (SM active or kernel running)" in printed(cell(nb, "gpu-findings"))


def test_05_stalls_are_named_periodic_stall_not_a_loader_problem(tmp_path):
    nb = execute("05-stalls.ipynb", tmp_path)
    rules = panel_rules(cell(nb, "watch-stalled"))
    assert "periodic-stall" in rules
    assert not rules & LOADER_RULES
    assert "measured gain:" in printed(cell(nb, "gain"))
    assert (tmp_path / "runs" / "checkpoint.pt").stat().st_size > 0


@pytest.mark.untimed
def test_06_exporting_runs_round_trips_and_writes_every_format(tmp_path):
    nb = execute("06-exporting-runs.ipynb", tmp_path)
    roundtrip = printed(cell(nb, "json-roundtrip"))
    for line in ("summary equal:  True", "findings equal: True", "same metrics:   True", "same spans:     True"):
        assert line in roundtrip
    assert len(panels(cell(nb, "json-roundtrip"))) == 1  # a loaded run shows its panel again
    for name in ("exported.json", "report.html", "metrics.csv", "spans.csv"):
        assert (tmp_path / "runs" / name).stat().st_size > 0
    sidebar = printed(cell(nb, "sidebar-snapshot"))
    assert sidebar.startswith(("No running Jupyter server found", "GPUs:")), sidebar


def test_07_multi_process_names_the_straggling_rank_and_its_loader(tmp_path):
    nb = execute("07-multi-process.ipynb", tmp_path)
    text, html = panels(cell(nb, "watch-straggler"))[0]
    assert "rank-straggler" in panel_rules(cell(nb, "watch-straggler"))
    assert "per process: rank | pid" in text and "<tr>" in html
    finding = printed(cell(nb, "straggler-finding"))
    assert "Rank 1 is a straggler" in finding and "(its data loader)" in finding
    assert re.search(r"rank 0: pid \d+, 32 steps", finding) and re.search(r"rank 1: pid \d+, 32 steps", finding)
    # Rank 1's loader no longer holds the others back (on a busy machine a rank may still wait for a core).
    (fixed_text, _), = panels(cell(nb, "watch-fixed"))
    assert "(its data loader) (rank-straggler)" not in fixed_text
    assert "measured speedup:" in printed(cell(nb, "compare"))
    # The command line: gpuwatch around torchrun sees both ranks and the same straggler.
    cli = printed(cell(nb, "cli"))
    assert "ranks seen: [0, 1]" in cli and "'rank-straggler'" in cli.split("ranks seen:")[1]
