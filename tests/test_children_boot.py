"""The child processes' start-up hook (``gpuwidget/children/_boot.py``): it waits for torch's module to
really run, whatever looks up torch's spec first (``datasets`` and ``transformers`` do at import).

site-packages holds the copy of ``_boot.py`` that the install made; these tests load this tree's
source instead: the finder in a fresh interpreter straight from the file, and end to end through a
directory on ``PYTHONPATH`` that holds the source under the installed module's name (the ``.pth``
line imports ``gpuwidget_children_boot`` from the first directory on the path that has it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gpuwidget
from gpuwidget import Run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BOOT = Path(gpuwidget.__file__).parent / "children" / "_boot.py"

# A fresh interpreter loads the source's finder from its file (no watch: the agent's start is
# recorded instead of run), then looks up torch's spec the way datasets/config.py does.
FINDER = textwrap.dedent("""\
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("boot_under_test", sys.argv[1])
    boot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boot)
    started = []
    boot.start_agent = lambda: started.append("torch" in sys.modules)

    def hooked():
        return sum(isinstance(finder, boot.AfterTorch) for finder in sys.meta_path)

    print("installed", hooked())
    found = importlib.util.find_spec("torch")
    print("looked up", found is not None, hooked(), "torch" in sys.modules, started)
    import torch
    print("imported", hooked(), started)
    print("torch's loader", type(torch.__loader__).__name__, type(torch.__spec__.loader).__name__)
""")


def test_looking_up_torchs_spec_keeps_the_hook_until_torch_is_imported():
    done = subprocess.run([sys.executable, "-c", FINDER, str(BOOT)], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "GPUWIDGET_CHILDREN"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "installed 1",
        "looked up True 1 False []",  # a spec, nothing imported, the hook still there, no agent yet
        "imported 0 [True]",  # the import itself ran the agent's start once, after torch, and the hook went
        "torch's loader SourceFileLoader SourceFileLoader",  # torch keeps its own loader
    ]


# The reproduction: torch's spec looked up before torch is imported, then 80 batches.
LOOKED_UP_FIRST = textwrap.dedent("""\
    import importlib.util
    importlib.util.find_spec("torch")
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(TensorDataset(torch.randn(320, 4), torch.randn(320, 1)), batch_size=4):
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
""")


def test_a_script_that_looks_up_torch_first_is_watched_under_gpuwatch(tmp_path: Path):
    hook = tmp_path / "hook"
    hook.mkdir()
    shutil.copyfile(BOOT, hook / "gpuwidget_children_boot.py")  # this tree's source, as the install names it
    script = tmp_path / "train.py"
    script.write_text(LOOKED_UP_FIRST)
    saved = tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "gpuwidget.cli", "--quiet", "--save", str(saved), "--",
                           sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    run = Run.load(saved)
    assert [entry["steps"] for entry in run.ranks] == [80]
    assert run.summary["steps"] == 80
