"""Advice on training code written the way real frameworks write it (Lightning, Hugging Face,
accelerate, torchvision-style transforms, IterableDatasets, tqdm): every ``.code`` runs as
pasted in the user's namespace and keeps the samples, and the probes see the real loop."""

from __future__ import annotations

import os
from typing import Any

import pytest

import gpuwidget
from gpuwidget.advice.code import loader_code
from gpuwidget.figures.summary import primary_loader

import frameworks

# Where the findings say the framework helpers are: relative to the working directory, as the user sees it.
FRAMEWORKS = os.path.relpath(frameworks.__file__)

CASES = {case.name: case for case in frameworks.cases()}
WORKER_CHANGE = {"num_workers": 2, "persistent_workers": True}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Each case run once per module: name -> (namespace, Run)."""
    results: dict[str, tuple[dict[str, Any], gpuwidget.Run]] = {}

    def get(name: str) -> tuple[dict[str, Any], gpuwidget.Run]:
        case = CASES[name]
        if not frameworks.available(case):
            pytest.skip(f"{case.frameworks} not installed")
        if name not in results:
            results[name] = frameworks.run_case(case, str(tmp_path_factory.mktemp("case")))
        return results[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_every_loader_finding_runs_as_pasted_and_keeps_the_samples(ran, name):
    case = CASES[name]
    namespace, run = ran(name)
    findings = frameworks.loader_findings(run)
    assert findings, f"no loader finding on a starved loop: {[f.rule for f in run.findings]}"
    loader = primary_loader(run.workload)
    # The worker change too, whichever loader rule the host's load let fire.
    codes = [f.code for f in findings] + [loader_code(loader, WORKER_CHANGE, run.workload)]
    for code in codes:
        result = frameworks.check_code(code, namespace, case)
        assert result.error is None, f"{code}\nraised {result.error}"
        assert result.same_samples is not False, f"{code}\nchanged the samples"
        if result.executable and case.loader is not None and "num_workers=2" in code:
            assert result.changed, f"{code}\nran but left the loader as it was"


def test_batch_sampler_loader_keeps_its_batch_sampler(ran):
    _, run = ran("batch_sampler= loader")
    code = loader_code(primary_loader(run.workload), WORKER_CHANGE, run.workload)
    assert "batch_sampler=train_loader.batch_sampler" in code and "batch_size" not in code


@pytest.mark.parametrize("name", ["IterableDataset, sharded", "IterableDataset, not sharded"])
def test_iterable_dataset_is_given_no_sampler(ran, name):
    _, run = ran(name)
    code = loader_code(primary_loader(run.workload), WORKER_CHANGE, run.workload)
    assert "sampler" not in code and "shuffle" not in code


def test_unsharded_iterable_dataset_is_told_to_shard_before_adding_workers(ran):
    _, run = ran("IterableDataset, not sharded")
    assert primary_loader(run.workload)["settings"]["shards_by_worker"] is False
    code = loader_code(primary_loader(run.workload), WORKER_CHANGE, run.workload)
    assert "every worker would yield every sample" in code and "get_worker_info" in code
    finding = next(f for f in frameworks.loader_findings(run) if "num_workers" in f.change)
    assert "does not split items between workers" in finding.suggestion
    _, sharded = ran("IterableDataset, sharded")
    assert primary_loader(sharded.workload)["settings"]["shards_by_worker"] is True


def test_framework_loaders_are_changed_in_the_frameworks_terms(ran):
    _, run = ran("accelerate")
    code = loader_code(primary_loader(run.workload), WORKER_CHANGE, run.workload)
    assert code.splitlines()[-1].startswith("train_dl = accelerator.prepare(DataLoader(train_ds, batch_size=8, ")
    _, run = ran("Hugging Face Trainer")
    assert primary_loader(run.workload)["owner"] == "transformers"
    code = loader_code(primary_loader(run.workload), WORKER_CHANGE, run.workload)
    assert "trainer.args.dataloader_num_workers = 2" in code and "DataLoader(" not in code


def test_loader_built_in_a_function_is_changed_where_it_is_built(ran):
    _, run = ran("loader from an imported function")
    loader = primary_loader(run.workload)
    assert loader["name"] is None and loader["built_at"]["file"].endswith("frameworks.py")
    code = loader_code(loader, WORKER_CHANGE, run.workload)
    assert f"make_loader() ({FRAMEWORKS}, line " in code
    assert "num_workers=2, persistent_workers=True)" in code and "shuffle=True" in code


@pytest.mark.parametrize(("name", "instance", "method"), [
    ("Lightning Trainer", "model", "Classifier.train_dataloader"),
    ("Lightning datamodule", "dm", "Storage.train_dataloader"),
])
def test_lightning_loader_is_changed_by_a_train_dataloader_the_trainer_calls(ran, name, instance, method):
    _, run = ran(name)
    loader = primary_loader(run.workload)
    assert loader["name"] is None and loader["owner"] == "lightning"
    assert loader["built_at"]["function"] == method and loader["user_names"]["built_by"] == instance
    code = loader_code(loader, WORKER_CHANGE, run.workload)
    assert f"{instance}.train_dataloader = types.MethodType(faster_train_dataloader, {instance})" in code
    assert ("return DataLoader(loader.dataset, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True)"
            in code)
    assert f"instead of {method} ({FRAMEWORKS}, line " in code


def test_cpu_bound_code_caches_before_the_random_augmentation(ran):
    from gpuwidget.advice.code import cache_code

    _, run = ran("torchvision-style transforms")
    code = cache_code(primary_loader(run.workload))
    assert f"Images.__getitem__ ({FRAMEWORKS}, line " in code and "before self.transform" in code


def test_tqdm_pass_is_one_epoch(ran):
    _, run = ran("tqdm")
    assert primary_loader(run.workload)["epochs"] == 1
    assert not any(f.change.get("persistent_workers") for f in run.findings)


def test_storage_bound_loops_sleep_while_waiting(ran):
    for name in ("batch_sampler= loader", "dict batches", "accelerate"):
        _, run = ran(name)
        assert primary_loader(run.workload)["wait_cpu_ratio"] < 0.25, name


def test_accelerate_loop_left_early_counts_the_batches_it_took(ran):
    namespace, _ = ran("accelerate")
    exec("with gpuwidget.watch(display=False) as run:\n"
         "    for step, (x, y) in enumerate(train_dl):\n"
         "        if step == 3:\n"
         "            break\n", namespace)
    loader = primary_loader(namespace["run"].workload)
    assert loader["steps"] == 4 and loader["samples"] == 32


def test_hf_trainer_stopping_at_max_steps_counts_the_steps_it_trained(ran):
    namespace, _ = ran("Hugging Face Trainer")
    namespace["trainer"].args.max_steps = 3
    exec("with gpuwidget.watch(display=False) as run:\n    trainer.train()\n", namespace)
    loader = primary_loader(namespace["run"].workload)
    assert loader["steps"] == 3 and loader["samples"] == 24


@pytest.mark.parametrize(("name", "model_class"), [("torchvision-style transforms", "Sequential"),
                                                   ("Lightning Trainer", "Classifier"),
                                                   ("Hugging Face Trainer", "GPT2LMHeadModel")])
def test_the_model_is_the_trained_module_under_the_users_name(ran, name, model_class):
    """Not a transform called per sample, nor the submodule a training_step calls first."""
    _, run = ran(name)
    model = run.workload["model"]
    assert model["class"] == model_class and model["name"] == "model"


def test_batch_probe_runs_a_lightning_module_without_forward_and_a_hf_dict_batch(ran):
    import torch

    from gpuwidget.measure.batch_probe import probe_batch_size

    pytest.importorskip("pytorch_lightning")
    module = frameworks.lightning_module(frameworks.SlowItems(latency=0))
    x, y = frameworks.item(0)
    result = probe_batch_size(module, (x.repeat(8, 1), y.repeat(8)), max_batch=16, budget_s=3)
    assert all(t.samples_per_s for t in result.trials)

    namespace, _ = ran("Hugging Face Trainer")
    ids = torch.randint(0, 32, (4, 8))
    labels = ids.clone()
    labels[:, :2] = -100  # the ignore index a collator pads labels with
    result = probe_batch_size(namespace["model"], {"input_ids": ids, "labels": labels}, max_batch=16, budget_s=3)
    assert all(t.samples_per_s for t in result.trials)


def test_tuner_does_not_count_an_unsharded_streams_copies_as_throughput():
    from torch.utils.data import DataLoader

    from gpuwidget.measure.tuner import tune_loader

    stream = DataLoader(frameworks.Stream(n=512, latency=0.003), batch_size=8)
    result = tune_loader(stream, budget_s=8, io_bound=True)
    as_it_is, *with_workers = result.trials
    assert with_workers, "no worker count was measured"
    # Each worker reads the whole stream: 4 workers deliver 4x the batches but no new data.
    for trial in with_workers:
        assert trial.error or trial.batches_per_s < 1.5 * as_it_is.batches_per_s, trial
    sharded = tune_loader(DataLoader(frameworks.ShardedStream(n=512, latency=0.003), batch_size=8), budget_s=8,
                          io_bound=True)
    assert sharded.chosen.batches_per_s > 1.5 * sharded.trials[0].batches_per_s


def test_loader_built_in_a_notebook_function_is_changed_at_its_cell_line(ip):
    ip.run_cell("import torch\nfrom torch.utils.data import DataLoader\nfrom frameworks import SlowItems, burn\n"
                "ds = SlowItems(n=64, latency=0.002)")
    defined_in = ip.execution_count  # the number the next stored cell runs as
    ip.run_cell("def train_epoch():\n"
                "    loader = DataLoader(ds, batch_size=8, shuffle=True)\n"
                "    for x, y in loader:\n"
                "        burn(0.001)\n", store_history=True)
    ip.run_cell("%%gpuwatch --quiet\ntrain_epoch()\n")
    run = gpuwidget.last_run()
    loader = primary_loader(run.workload)
    assert loader["name"] is None and loader["built_at"]["cell"] == defined_in
    code = loader_code(loader, WORKER_CHANGE, run.workload)
    assert code == (f"# This DataLoader is built in train_epoch() (cell In [{defined_in}], line 2); build it there as\n"
                    "#     DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True)")


def test_loader_built_inline_in_a_watched_cell_is_changed_at_its_line(ip):
    ip.run_cell("from torch.utils.data import DataLoader\nfrom frameworks import SlowItems\n"
                "ds = SlowItems(n=64, latency=0.002)")
    ip.run_cell("%%gpuwatch --quiet\nfor batch in DataLoader(ds, batch_size=8):\n    pass\n")
    loader = primary_loader(gpuwidget.last_run().workload)
    code = loader_code(loader, WORKER_CHANGE, gpuwidget.last_run().workload)
    assert f"built at line 2 of cell In [{loader['built_at']['cell']}]; build it there as" in code
    assert code.endswith("DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)")


def test_tuner_code_for_a_loader_no_name_holds_says_where_it_is_built(ran):
    from gpuwidget.measure.tuner import tune_for_run

    namespace, run = ran("loader from an imported function")
    result = tune_for_run(run, eval("make_loader(train_ds)", namespace), budget_s=3)
    assert f"make_loader() ({FRAMEWORKS}, line " in result.code and "loader =" not in result.code


def test_tuner_code_for_a_lightning_loader_replaces_train_dataloader(ran):
    from gpuwidget.measure.tuner import tune_for_run

    namespace, run = ran("Lightning Trainer")
    result = tune_for_run(run, namespace["model"].train_dataloader(), budget_s=3)
    assert result.code.endswith("model.train_dataloader = types.MethodType(faster_train_dataloader, model)")
