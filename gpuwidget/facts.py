"""The shapes of the facts that cross layers: summary, workload and machine, as TypedDicts.

These are plain dicts at run time (``Run.summary``, ``Run.workload``, ``Run.machine`` and
their JSON stay what DESIGN.md's public contract says); the types let mypy check every
lookup a rule makes. ``total=False`` where a key may be absent: a figure the run cannot
support (no GPU, no DataLoader seen) is missing or None, never a guess. Units are in the
comments; percentages are 0-100, fractions 0-1.

Who fills what: :func:`gpuwidget.figures.summary.summarize` a :class:`Summary`,
:meth:`gpuwidget.probes.Probes.facts` a :class:`WorkloadFacts`, :meth:`gpuwidget.sources.host.HostSource.machine_facts`
plus the GPU sources' devices a :class:`MachineFacts`. A new key goes here first, with its unit.

Per-GPU maps (``gpu_busy_by_gpu``...) are keyed by the CUDA index as a string ("0"), as JSON
writes them, so a live run and one read back with ``Run.load`` hold the same keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, cast

# --------------------------------------------------------------------------- workload


class LoaderConstructor(TypedDict, total=False):
    """How a DataLoader subclass's ``__init__`` hands its arguments to DataLoader's
    (``probes.constructor.constructor_facts``): what a rebuilt loader of the user's class may pass."""

    class_name: str  # the subclass's own name
    code: CodeSite | None  # file, function, line of the __init__ that hands on (absent: DataLoader's own)
    known: bool  # that hand-over was read; False: ``reason`` says why not
    reason: str
    dataset: str  # "positional", "fixed" (it makes its own), or the keyword of the parameter taking it
    keywords: dict[str, str]  # DataLoader parameter -> the constructor's parameter that takes it
    fixed: list[str]  # DataLoader parameters the constructor sets itself
    attributes: dict[str, str]  # its own parameter -> the loader attribute that keeps its value
    defaults: dict[str, int | None]  # its own parameters no attribute keeps -> position (None: keyword-only)
    missing: list[str]  # its own required parameters no attribute keeps


class InnerBatching(TypedDict):
    """The ``BatchSampler`` a framework's batch sampler wraps (accelerate's ``BatchSamplerShard``)."""

    batch_size: int
    drop_last: bool
    shuffle: bool  # its sampler is a RandomSampler
    plain_sampler: bool  # one that shuffle=True/False rebuilds exactly


class LoaderSettings(TypedDict, total=False):
    """One DataLoader's configuration (``probes.torch_data.loader_settings``); empty when the
    probe saw an iterator before its loader."""

    batch_size: int | None
    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None
    persistent_workers: bool
    multiprocessing_context: str | None  # start method: "fork", "spawn", "forkserver"
    drop_last: bool
    timeout: float  # seconds
    shuffle: bool
    sampler: str | None  # class name
    custom_sampler: bool
    custom_batch_sampler: bool
    collate_fn: str  # function or class name
    default_collate: bool
    dataset_type: str  # class name
    dataset_len: int | None  # None for a dataset without len()
    iterable_dataset: bool
    worker_init_fn: str | None  # function name
    batch_sampler_given: bool  # built with batch_sampler= (batch_size is None)
    inner_batching: InnerBatching  # the batching of that batch sampler
    generator: bool  # the loader has its own torch.Generator
    shards_by_worker: bool | None  # IterableDataset reads get_worker_info(); None: unknown or map-style
    dataset_code: CodeSite | None  # file, function, line of the dataset's __getitem__/__iter__
    collate_code: CodeSite | None  # ... of the collate function (a collator object's __call__)
    dataset_transforms: list[str]  # the dataset's attributes holding per-sample transforms
    constructor: LoaderConstructor | None  # the loader's own class's constructor; None: torch's DataLoader


class LoaderChange(TypedDict, total=False):
    """A loader finding's change (``Finding.change`` of ``dataloader-starved``, ``io-bound``, ``small-batch``,
    ``pageable-transfer``): the DataLoader settings to set, as ``advice.code`` writes them and the
    tuner (``measure.tuner``) builds a loader with them. Only the settings that change are present."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int  # batches each worker prepares ahead
    batch_size: int  # small-batch's larger batch


class LoaderFacts(TypedDict, total=False):
    """What one DataLoader did during the watch (``probes.torch_data.LoaderStats.facts``)."""

    name: str | None  # the user's variable name for the loader, when one holds it
    dataset_name: str | None  # the user's variable name for its dataset
    settings: LoaderSettings
    epochs: int  # times the loader was iterated
    steps: int  # batches taken
    samples: int  # sum of each batch's first dimension
    wait_total_s: float  # seconds blocked in next(), less Python's garbage collections in it (gc_wait_s)
    gc_wait_s: float  # seconds of Python's garbage collections inside next(), counted as the loop's own time
    compute_total_s: float  # seconds between next() calls (the loop's own work)
    loop_time_s: float  # wait_total_s + compute_total_s
    wait_cpu_ratio: float | None  # CPU seconds of the looping thread per wall second while blocked in next()
    wait_delay_ratio: float | None  # its run delay (runnable, waiting for a core) per wall second then
    wait_sampled_s: float  # wall seconds of the waits those two were read over (probes.torch_data.sample_stride)
    wait_samples: int  # how many waits those were
    # "thread": the CPU read from the thread's CPU clock, exact; absent in runs saved before (schedstat's figure)
    wait_cpu_clock: str
    collate_share: float | None  # of the sampled waits without workers, the share in the collate function
    # Device type of the batches' tensors as next() returned them ("cpu"; "cuda": a dataset already on
    # the GPU, nothing to pin); None: not read (an older run, or no tensor in the batch).
    batch_device: str | None
    step_times: list[float]  # seconds per step, the latest STEP_HISTORY of them
    wait_times: list[float]  # seconds blocked per next(), the latest STEP_HISTORY
    owner: str | None  # framework that built or drives it: "transformers", "accelerate", "lightning"
    # file, function, line (and cell: the notebook cell's number) of the user's code that built it
    built_at: CodeSite | None
    # Optimizer steps of the trained model taken right after one of this loader's batches: the loader
    # that feeds the training loop (probes.torch_steps); 0 for a validation loader, absent in older runs.
    steps_fed: int
    # role ("class", "collate_fn", "batch_sampler", "sampler", "built_by": the object whose method
    # built the loader, a LightningModule or datamodule) -> the user's name for it, where one holds it
    user_names: dict[str, str]


class AutocastState(TypedDict, total=False):
    """torch.autocast as the model's first forward pass saw it."""

    enabled: bool
    dtype: str | None  # "float16", "bfloat16"; None when disabled
    device_type: str  # "cuda", "cpu"


class DdpFacts(TypedDict, total=False):
    """DistributedDataParallel's own logging data (``model._get_ddp_logging_data()``), its numeric and
    boolean fields under torch's names, read at the end of the run (``probes.torch_model.ddp_logging_facts``).
    Times are nanoseconds averaged over the iterations DDP samples (1-10, then every 100th)."""

    world_size: int
    rank: int
    iteration: int  # the last iteration DDP sampled
    avg_forward_compute_time: int  # ns
    avg_backward_compute_time: int  # ns: first to last gradient ready
    avg_backward_comm_time: int  # ns: first bucket's all-reduce launched to the last one done
    avg_backward_compute_comm_overlap_time: int  # ns: all-reduce running while backward still computed
    # The same four of the latest sampled iteration alone
    forward_compute_time: int
    backward_compute_time: int
    backward_comm_time: int
    backward_compute_comm_overlap_time: int
    bucket_cap_bytes: int  # bucket_cap_mb in bytes
    bucket_sizes: list[int]  # bytes per bucket as first built
    rebuilt_bucket_sizes: list[int]  # bytes per bucket after DDP rebuilt them in gradient-ready order
    total_parameter_size_bytes: int
    num_parameter_tensors: int
    unused_parameter_size: int  # bytes
    gradient_as_bucket_view: bool
    find_unused_parameters: bool
    broadcast_buffers: bool
    has_sync_bn: bool
    has_rebuilt_buckets: bool
    static_graph: bool  # the wrapper's static_graph (not in the logging data)
    # The latest-iteration figures of each read of the logging data (not in it): iteration and the four
    # times above under their names, for the most recent sampled iterations the probe saw (oldest first)
    iterations: list[dict[str, int]]


# The main model (most parameters) from its first forward passes (``probes.torch_model``).
# "class" is a keyword: the functional form spells the key as the probe writes it.
ModelFacts = TypedDict("ModelFacts", {
    "name": str | None,  # the user's variable name for the model
    "class": str,  # the module's class name
    "parameters": int,  # parameter count
    "param_dtypes": dict[str, int],  # dtype name -> parameters of that dtype
    "param_devices": list[str],  # device types holding parameters ("cpu", "cuda")
    "input_dtype": str | None,
    "input_device": str | None,
    "autocast": AutocastState,
    "compiled": bool,  # torch.compile'd
    "training": bool,
    "calls": int,  # top-level forward calls seen (at most probes.torch_model.TOP_LEVEL_CALLS)
    "float32_matmul_precision": str,  # "highest", "high", "medium"
    "cuda_matmul_allow_tf32": bool,
    "cudnn_allow_tf32": bool,
    "tf32_api": str,  # "fp32_precision" (torch's current switches) or "legacy"
    "matmul_fp32_precision": str | None,  # effective torch.backends.cuda.matmul.fp32_precision: "ieee", "tf32"
    "conv_fp32_precision": str | None,  # effective torch.backends.cudnn.conv.fp32_precision
    "data_parallel": bool,  # the model is a torch.nn.DataParallel
    "data_parallel_gpus": int,  # its device_ids (0 without CUDA)
    "ddp": DdpFacts,  # present when the model is a DistributedDataParallel
}, total=False)


class CudaDeviceFacts(TypedDict, total=False):
    """One CUDA device as torch reports it, with the cell's peak memory on it."""

    index: int  # CUDA index (after CUDA_VISIBLE_DEVICES)
    name: str
    capability: list[int]  # [major, minor]
    total_memory: int  # bytes
    peak_allocated: int  # bytes, torch.cuda.max_memory_allocated
    peak_reserved: int  # bytes, torch.cuda.max_memory_reserved
    uuid: str  # the device's UUID as torch gives it (no "GPU-" prefix), to match the driver's device


class CudaFacts(TypedDict, total=False):
    """CUDA memory of the cell (``probes.torch_model.CudaMemoryProbe``); absent without CUDA."""

    devices: list[CudaDeviceFacts]
    peak_since_cell_start: bool  # False: the peaks may predate the cell (CUDA started inside it)


class CodeSite(TypedDict, total=False):
    """A line of the user's code, named as the user knows it."""

    function: str  # qualified name ("get_batch", "Batcher.next"); "<module>" for a cell's or script's own lines
    file: str  # relative to the working directory where under it, else absolute (a cell: IPython's file for it)
    line: int
    cell: int | None  # the notebook cell's execution number ("cell In [7]"), None for a file


class HostCopy(TypedDict, total=False):
    """The host-to-device copies (``.to(...)``, ``.cuda()``) on a line the loop waited at (``probes.stack``)."""

    tensors: list[str]  # the names copied (``x`` in ``x.to(device)``), as the line spells them
    same_each_step: bool  # the copied names are the user's tensors, the same objects at every step
    once: str | None  # a statement that moves them to the device once, in the user's names, where it is valid
    rewritten: str | None  # the line with pinned memory and non_blocking=True copies


class LoopWait(CodeSite, total=False):
    """A function the loop waited in (``probes.stack``): stack samples of the watched thread inside
    ``train.between`` spans or, inside ``train.step``, in a function of the user's outside torch's
    work (without optimizer steps: inside ``loader.wait``)."""

    share: float  # of the loop's samples (0-1): the share of the loop's time spent waiting there
    seconds: float  # share x the loop's time (the loop spans' total)
    samples: int  # stack samples there
    in_loader: float  # share of those samples inside a DataLoader's next() (0-1)
    in_model: float  # share of those samples inside torch's work (a model's forward between steps: 0-1)
    in_framework: float  # share of those samples in a training framework's code above it (Lightning's loop: 0-1)
    step_ratio: float  # the loop step its samples fell in (their median) over the loop's median step: ~1 in
    # every step, many times 1 where the wait is what makes some steps slow (a periodic evaluation)
    in_loop: bool  # the loop's own function (the one calling the model, backward, the optimizer) or one around it
    source: str | None  # the line's text, stripped
    called_from: CodeSite  # the outermost frame of the user's code: the cell's (or script's) line
    name: str | None  # the user's name for the function, an assignment target ("get_batch", "batcher.next")
    generator: bool  # a generator function: its caller iterates it
    copy: HostCopy | None  # the line copies tensors to a device
    timed: bool  # a collate function the DataLoader probe timed, not stack samples (dataloader_cpu_bound.batch_builder)


class StackFacts(TypedDict, total=False):
    """The stack sampler itself (``probes.stack.StackSampler``): how much evidence ``loop_waits`` rests on."""

    basis: str  # the wait spans samples were attributed to: "train.between" or "loader.wait"
    samples: int  # stack samples taken over the watch
    loop_samples: int  # of them inside the loop's steps (``train.step``; without optimizer steps, ``step``)
    steps: int  # the loop's steps seen (spans of that kind)
    loop_s: float  # seconds in the loop's steps
    tick_us: float  # mean CPU time of one sample and its attribution, microseconds (sampler thread)
    late_ms: float  # mean delay from a tick's due time to its sample (waiting for the GIL), milliseconds
    dropped: int  # ticks read too long after they were due (probes.stack.LATE_SWITCHES): counted in the
    # span they were due in, never located
    unplaced: int  # waits (in loop_samples) read after their wait had ended: shared out among the placed ones


class ProcessCpu(TypedDict, total=False):
    """CPU seconds a process used since it started (``gpuwidget.children.agent.cpu_seconds``)."""

    process_s: float  # all its threads
    workers_s: float  # its child processes (DataLoader workers)


class MainThreadFigures(TypedDict, total=False):
    """A process's main thread over its life, from the kernel's schedstat (the watch's own: its summary)."""

    cpu_fraction: float  # on a core, share of wall time (0-1)
    run_delay_fraction: float  # runnable but waiting for a core, share of wall time (0-1)
    cpu_count: int | None  # the CPUs it may run on


class RankEntry(TypedDict, total=False):
    """One training process of a run (``workload["ranks"]``, ``gpuwidget.children.ranks``). The first
    eight keys are ``Run.ranks``' (DESIGN.md); the rest are that process's evidence for the rules."""

    rank: int | None  # torch.distributed's rank (or the launcher's RANK), None outside a process group
    pid: int
    gpu: int | None  # the watch's GPU number of its CUDA device
    steps: int
    samples_per_s: float | None
    data_wait_fraction: float | None
    step_time_p50_s: float | None
    step_time_p95_s: float | None
    local_rank: int | None
    world_size: int | None
    loop_time_s: float  # seconds in its training loop
    step_source: str | None  # "dataloader", "optimizer" or "forward": which steps its figures count (the summary's)
    loop_waits: list[LoopWait]  # its stack samples' top wait (probes.stack), where it sampled any
    stack_samples: StackFacts  # a child's stack sampler, until merged (children.ranks.merge: then the workload's)
    # Its steps one by one, the latest ranks.SERIES_STEPS: seconds per step, and of each the
    # seconds blocked on data (same length, same order)
    step_times: list[float]
    wait_times: list[float]
    time_breakdown: TimeBreakdown  # its time over the run's duration (the parts sum to it)
    cpu: ProcessCpu
    host: MainThreadFigures
    loaders: list[LoaderFacts]  # without the per-step lists
    model: ModelFacts | None
    training: TrainingFacts | None  # its optimizer's steps (probes.torch_steps)
    cuda: CudaFacts | None
    finished: bool  # False: it was killed or crashed, and its figures are those it last sent
    argv: list[str] | None


class TrainingFacts(TypedDict, total=False):
    """The training loop as its optimizer steps tell it (``probes.torch_steps.StepProbe``), whatever
    feeds it: a DataLoader, a generator, ``get_batch``. Times are on the trace's clock (seconds)."""

    # optimizer.step() calls of the trained model's optimizer; where none steps it and the loop updates
    # the parameters itself (step_source "forward"), the model's training forwards
    optimizer_steps: int
    step_times: list[float]  # seconds per optimizer step, the latest STEP_HISTORY of them
    step_ends: list[float]  # trace-clock time of each of those steps' end, same length (warm-up split)
    # top-level forward calls of the trained model seen (after its optimizer was known): every one in the
    # first steps, then (forwards_sampled) those in the windows opened at sampler ticks (probes.torch_steps)
    forward_calls: int
    eval_forwards: int  # of those, the calls with grad disabled (an evaluation between steps)
    forwards_sampled: bool  # the calls after the first steps were seen in windows, not all of them
    autocast_share: float  # share of those forward calls that ran under torch.autocast (0-1)
    autocast_dtype: str | None  # the dtype most of them ran under ("bfloat16", "float16")
    flops_per_step: float  # FlopCounterMode's count for one training step (forward and backward), FLOPs
    flops_counted_at_step: int  # which step was counted (0-based)
    flops_dtype: str  # the dtype most counted FLOPs ran in: "fp8", "bf16", "fp16", "tf32", "fp32", "fp64"
    flops_missing: str  # why no step was counted (too few steps, the counter failed)
    flops_step_s: float  # seconds the counted step took (with the counter's own cost; not in step_times)
    samples_per_step: int | None  # the first dimension of the trained model's inputs in one step
    # seconds in the train.between spans measured (a step's end to the next training forward): each step's
    # in the first steps, then one per sampler tick where forwards_sampled; between_spans: how many
    between_s: float
    between_spans: int
    loop_s: float  # seconds from the first train.step span's start to the last one's end
    spanned_steps: int  # steps with a train.step span in loop_s (a first step seen before its model has none)
    # "optimizer": the steps are the optimizer's; "forward": no optimizer steps the model, and a step runs
    # from one training forward to the next (its parameters changed between them: a manual update)
    step_source: str
    model_class: str | None  # the trained model's class (the module whose parameters the optimizer holds)
    device_type: str | None  # where its parameters are ("cuda", "cpu")


class TrainedIn(TypedDict):
    """The child process whose loaders and model the workload's are (``children.ranks.merge``)."""

    pid: int
    rank: int | None


class WorkloadFacts(TypedDict, total=False):
    """What the probes saw of the user's workload (``probes.Probes.facts``)."""

    torch: str | None  # torch.__version__, None when the cell never imported torch
    loaders: list[LoaderFacts]  # in the order first iterated
    model: ModelFacts | None
    cuda: CudaFacts | None
    training: TrainingFacts | None  # from optimizer steps; None when no optimizer stepped
    probe_errors: list[str]  # why a probe could not run or be removed
    frameworks: dict[str, str]  # role ("hf_trainer", "training_args", "accelerator") -> the user's name
    # One entry per training process, the watch's own included when it trained (gpuwidget.children.ranks).
    ranks: list[RankEntry]
    trained_in: TrainedIn  # the child whose loaders and model these are (the watch's own process did not train)
    # Where the loop waited between steps, largest share first (probes.stack), and the sampler behind it.
    loop_waits: list[LoopWait]
    stack_samples: StackFacts
    gc: GcFacts  # Python's garbage collections while the DataLoader probe was installed (probes.gc_pauses)


class GcFacts(TypedDict, total=False):
    """Python's garbage collections during a watch (``probes.gc_pauses``)."""

    collections: int
    seconds: float  # all of them
    longest_s: float  # the longest one


# --------------------------------------------------------------------------- machine


class GpuFacts(TypedDict, total=False):
    """One GPU's static facts, whatever its vendor: what a GPU source's ``describe()`` gives for each
    device it reads (:class:`gpuwidget.sources.gpu.GpuSource`), kept in ``Run.machine["gpus"]``.

    Fields a vendor does not have are absent or None (an AMD GPU has no CUDA ``capability``; an NVIDIA
    GPU no ``compute_partition``). A GPU's slices (an NVIDIA MIG instance, an AMD compute partition)
    are devices of their own, ``is_mig`` for both, named after their GPU by ``parent_uuid``.
    """

    id: str  # the column prefix: "gpu0"
    index: int  # the framework's index (torch.cuda numbering: after CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)
    vendor: str  # "nvidia" or "amd"
    driver_index: int  # the driver's own number (nvidia-smi's, amd-smi's), as exporters label GPUs
    uuid: str
    name: str
    memory_total: int | None  # bytes
    power_limit: float | None  # watts
    sm_clock_max: float | None  # Hz (the SM clock on NVIDIA, the GFX clock on AMD)
    is_mig: bool  # a slice of a GPU: an NVIDIA MIG instance or an AMD compute partition (XCP)
    parent_uuid: str | None
    pci_bus_id: str | None
    # SM activity is measured (NVIDIA GPM, Hopper and newer): the busy figure is sm_active
    gpm: bool
    mig_mode: bool  # a GPU in MIG mode (its instances are the CUDA devices; listed in the server's view)
    gpu_instance_id: int | None  # a MIG instance's GPU instance id (dcgm-exporter's GPU_I_ID)
    mig_profile: str | None  # a MIG instance's profile, "3g.40gb" (dcgm-exporter's GPU_I_PROFILE)
    compute_partition: str | None  # an AMD GPU's compute partition mode: "SPX", "DPX", "CPX"...
    memory_partition: str | None  # an AMD GPU's memory partition mode: "NPS1", "NPS4"...
    partition_id: int | None  # an AMD compute partition's number on its GPU (the exporter's gpu_partition_id)
    serial: str | None  # the board's serial number (AMD's exporter labels series with it)
    capability: list[int] | None  # CUDA compute capability [major, minor]; None on AMD
    arch: str | None  # the chip's instruction set on AMD ("gfx942"); None on NVIDIA
    power_limit_default: float | None  # watts, the board's default power limit
    pcie_gen_max: int | None  # PCIe generation the GPU and its slot allow
    pcie_width_max: int | None  # PCIe lanes the GPU and its slot allow
    foreign_pid_namespace: bool  # the driver reports pids of another PID namespace (a container)
    lost: str | None  # why the GPU stopped answering, None while it answers


# Keys GpuFacts had under an earlier name, for runs saved before (Run.load): old -> new.
GPU_FACT_RENAMES = {"nvml_index": "driver_index"}


def saved_machine(machine: Mapping[str, Any]) -> MachineFacts:
    """A saved run's machine facts with each GPU's keys as GpuFacts names them now (GPU_FACT_RENAMES);
    a run saved before vendors were told apart read NVIDIA GPUs only."""
    facts = cast(MachineFacts, dict(machine))
    gpus = []
    for gpu in machine.get("gpus") or []:
        renamed = {GPU_FACT_RENAMES.get(key, key): value for key, value in gpu.items()}
        if "driver_index" in renamed and "vendor" not in renamed:
            renamed["vendor"] = "nvidia"
        gpus.append(cast(GpuFacts, renamed))
    if "gpus" in machine:
        facts["gpus"] = gpus
    return facts


def uuid_key(uuid: str) -> str:
    """A GPU's UUID as its driver ("GPU-58c6...", "MIG-...") and torch ("58c6...") spell it, made comparable."""
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


class MachineFacts(TypedDict, total=False):
    """The host and GPUs a run is judged against (``HostSource.machine_facts`` + the GPU sources' devices)."""

    cpu_count: int | None  # logical CPUs of the host
    usable_cpus: int  # CPUs this process may keep busy: affinity within the cgroup's limits (sources.cgroup)
    cpu_limit: float | None  # the cgroup's CPU-time quota in cores (1.5 = 150000/100000), None: no quota
    mem_limit: int | None  # the cgroup's memory limit, bytes; None: no limit
    mem_total: int  # bytes of host memory
    pid: int  # the watched process
    gpus: list[GpuFacts]  # empty without a GPU
    gpu_message: str | None  # why no GPU is shown, None when there are GPUs


# --------------------------------------------------------------------------- summary


class TimeBreakdown(TypedDict, total=False):
    """Where the time of the process that trained went, seconds; the parts sum to the run's duration
    (``figures.summary.time_breakdown``)."""

    data_wait_s: float  # blocked in next() of any loader
    compute_s: float  # the rest of the loop's steps, each second once (nested loaders are not counted twice)
    # Where the trace holds every step: before the first (process start-up, imports, set-up) and after
    # the last (saving, tear-down); other_s is then the gaps between steps
    before_loop_s: float
    after_loop_s: float
    other_s: float  # the rest: evaluation outside a DataLoader, between epochs


class Summary(TypedDict, total=False):
    """A run's headline figures (``figures.summary.summarize``); DESIGN.md's public contract.

    Loop figures refer to the primary loader (the one whose batches fed the optimizer's steps; without
    optimizer steps, the one the cell iterated longest), or to the optimizer's steps when no DataLoader
    fed them (``step_source``).
    """

    duration_s: float  # the watched cell, wall seconds
    loader: str | None  # the primary loader's name
    steps: int | None
    samples: int | None
    samples_per_s: float | None  # over the steady steps (the warm-up's left out: figures.summary.steady_headline)
    steps_per_s: float
    loop_time_s: float  # seconds inside the primary loader's loop
    data_wait_fraction: float | None  # share of the steady steps' time blocked in next()
    # The same three over every step, the warm-up's included, where a warm-up was split off.
    samples_per_s_with_warmup: float
    steps_per_s_with_warmup: float
    data_wait_fraction_with_warmup: float
    step_time_p50: float | None  # seconds
    step_time_p95: float | None
    step_time_p99: float | None
    # The steps before the loop's steady state (gpuwidget.figures.warmup), left out of the step
    # percentiles and of periodic-stall's period: how many, their seconds, what they were where
    # the facts say ("compilation", "CUDA start-up", "worker start-up"); all_warmup when the
    # run never reached a steady state (then every step is counted as warm-up).
    warmup_steps: int
    warmup_s: float
    warmup_cause: str
    all_warmup: bool
    time_breakdown: TimeBreakdown
    cpu_util_mean: float | None  # host CPU, percent of all cores
    process_cpu_mean: float | None  # this process, percent of one core (can exceed 100)
    workers_cpu_mean: float | None  # its child processes (loader workers), percent of one core, from the
    # first batch to the last where the trace holds them (worker start-up and tear-down left out)
    # Kernel counters (gpuwidget.sources.host), present only where the platform has them:
    process_run_delay_mean: float  # main thread runnable but waiting for a core, percent of wall time
    workers_run_delay_mean: float  # the workers' run delay summed, percent of one core (first to last batch)
    other_cpu_mean: float  # processes outside this tree on its CPUs, percent of one core
    psi_cpu_some_mean: float  # host PSI: some task waited for a CPU, percent of wall time
    psi_io_some_mean: float  # host PSI: some task waited on I/O, percent of wall time
    psi_cgroup_cpu_some_mean: float  # this cgroup's cpu.pressure "some", percent of wall time
    # The busy figure users read, percent, mean over the GPUs judged (gpu_busy_basis): GPM's SM activity
    # where every judged GPU has it (Hopper and newer, MIG instances included), else the driver's utilisation.
    gpu_busy_mean: float
    gpu_busy_metric: str  # "sm_active" (GPM) | "kernel_running" (the driver's utilisation) : what gpu_busy_mean is
    gpu_kernel_running_mean: float  # the driver's utilisation ("kernel running"), percent, judged GPUs
    gpu_kernel_running_by_gpu: dict[str, float]  # the same per CUDA index ("0"), where the driver reports it
    gpu_busy_missing: str  # why no busy figure exists, in words (a MIG instance without GPM)
    gpus_judged: int  # how many GPUs the GPU figures (and the cost) are over
    gpu_busy_basis: str  # "used": the GPUs this workload used; "visible": no sign of use, every GPU
    gpus_used: list[int]  # CUDA indexes where this workload's processes or torch held memory
    gpus_unused_idle: list[int]  # the other GPUs, idle (under summary.IDLE_UTIL_PERCENT)
    gpus_unused_busy: list[int]  # the other GPUs, busy with someone else's work
    gpu_sm_active_mean: float  # GPM SM activity, percent, mean over judged GPUs (Hopper and newer)
    gpu_tensor_active_mean: float  # GPM tensor-pipe activity, percent, mean over judged GPUs
    gpu_nvlink_tx_mean: float  # GPM NVLink bytes/s sent, mean over judged GPUs
    gpu_nvlink_rx_mean: float  # GPM NVLink bytes/s received, mean over judged GPUs
    gpu_power_capped_fraction: float  # share of busy samples at the software power cap (worst GPU)
    gpu_power_limit_ratio: float  # enforced power limit / the board's default (lowest GPU)
    gpu_pcie_link_by_gpu: dict[str, dict[str, int]]  # pcie_gen, pcie_width (best seen), *_max, per GPU
    gpus_pcie_degraded: list[int]  # GPUs whose link stayed below its generation or width
    gpu_pid_namespace_foreign: bool  # the driver's pids are not this process's namespace (a container)
    process_gpu_mem_source: str  # "driver" (its per-process list) or "torch" (memory_reserved)
    gpu_busy_by_gpu: dict[str, float]  # the busy figure (gpu_busy_metric's where the GPU has it), per CUDA index
    gpu_idle_gaps: int  # gaps of at least summary.IDLE_GAP_S with the busy figure under summary.IDLE_UTIL_PERCENT
    gpu_longest_idle_s: float
    gpu_throttle_fraction: float  # share of busy samples with a slowdown reason (thermal, HW, brake), worst GPU
    gpu_throttle_fraction_by_gpu: dict[str, float]  # the same per CUDA index ("0"), to name a rank's GPU
    gpu_clock_ratio_busy: float  # SM clock / its maximum while busy (worst GPU)
    process_gpu_mem_peak: float  # bytes this process held on a GPU, peak
    peak_gpu_mem_fraction: float  # of total memory, worst GPU
    peak_gpu_mem_fraction_by_gpu: dict[str, float]  # per CUDA index ("0")
    training_processes: int  # processes that trained (workload["ranks"] with steps); loop figures are the job's if > 1
    # Set when only child processes trained (gpuwidget.children.ranks): process_cpu_mean and
    # workers_cpu_mean are then theirs, summed over this many processes, not the watch's own.
    process_cpu_processes: int
    # the driver's energy counter (NVIDIA Volta and newer, AMD Instinct), over the watched cell, the GPUs
    # judged summed; absent where any of them can't report it. Per sample and per step where the loader counted them.
    energy_j: float
    energy_per_sample_j: float
    energy_per_step_j: float
    # With a price per GPU-hour (--price, GpuWidget.gpu_hour_price): gpus_judged x the cell's hours x price,
    # and the idle share of it (1 - gpu_busy_mean / 100; absent without a busy figure), in the price's currency.
    gpu_hour_price: float
    cost: float
    idle_cost: float
    # The training loop's steps as the optimizer counted them (summary.training_figures):
    # "dataloader" (the primary loader's batches), "optimizer" (its step() calls) or "forward" (the
    # trained model's training forwards, where no optimizer steps it: probes.torch_steps)
    step_source: str
    optimizer_steps: int  # optimizer.step() calls of the trained model's optimizer (not with "forward")
    flops_per_step: float  # FLOPs of one training step (forward and backward), FlopCounterMode's count
    flops_dtype: str  # the dtype the counted matmuls ran in: "fp8", "bf16", "fp16", "tf32", "fp32"
    achieved_flops_per_s: float  # flops_per_step over the mean time of the steady steps
    peak_flops_per_s: float  # the chip's dense peak for flops_dtype (gpuwidget.peaks), where a GPU trained
    mfu: float  # achieved_flops_per_s / peak_flops_per_s (0-1), where a GPU trained and its peak is known
    mfu_missing: str  # why there is no MFU (no GPU trained, a chip or dtype the peak table lacks)
