"""Where a DataLoader came from: the user's code that built it and the framework that owns it.

A suggestion can only rebind a name the user has, or else it must speak the owning
framework's terms (Hugging Face ``TrainingArguments``, ``accelerator.prepare``, a
LightningModule's ``train_dataloader``) or point at the line that built the loader. These
helpers read that from the Python stack when a loader is built or first iterated (a few
dozen frame lookups, once per loader, never per batch), and from the user's namespace.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import sys
import weakref
from collections.abc import Collection, Mapping
from types import FrameType
from typing import Any, TypedDict

from gpuwidget.facts import CodeSite, LoaderSettings

# Top-level packages of the frameworks that build or drive DataLoaders themselves.
FRAMEWORKS = {"transformers": "transformers", "accelerate": "accelerate", "pytorch_lightning": "lightning",
              "lightning": "lightning", "lightning_fabric": "lightning"}
# Frames of these packages are never "the user's code" (torch builds loaders for itself too).
LIBRARIES = {"torch", "gpuwidget", "tqdm", *FRAMEWORKS}
# How far up the stack to look: deeper than any framework's fit loop seen.
MAX_FRAMES = 80
# Attributes a torchvision-style dataset keeps its per-sample transforms in.
TRANSFORM_ATTRIBUTES = ("transform", "transforms", "augment", "augmentation")
# User objects whose names a suggestion may use: (module prefix, class name) -> role.
FRAMEWORK_OBJECTS = {
    ("transformers.trainer", "Trainer"): "hf_trainer",
    ("transformers.training_args", "TrainingArguments"): "training_args",
    ("accelerate.accelerator", "Accelerator"): "accelerator",
    ("pytorch_lightning.trainer.trainer", "Trainer"): "lightning_trainer",
    ("lightning.pytorch.trainer.trainer", "Trainer"): "lightning_trainer",
}


class Origin(TypedDict):
    """Where on the stack an object (a DataLoader) was built or first iterated (:func:`stack_origin`)."""

    site: CodeSite | None  # the innermost frame of the user's code
    inner: list[str]  # frameworks between it and the object: they built it
    outer: list[str]  # frameworks above it: they called the user's code
    instance: weakref.ref[Any] | None  # the ``self`` of the site's method, weakly


# What an object not seen being built or iterated has of an origin.
NO_ORIGIN: Origin = {"site": None, "inner": [], "outer": [], "instance": None}


def stack_origin(frame: FrameType | None, constructing: Any = None) -> Origin:
    """The innermost frame of user code above ``frame`` (file, function, line), the frameworks
    between it and ``frame`` (``inner``: they built the object) and those above it (``outer``:
    they called the user's code, as Lightning calls ``train_dataloader``).

    ``constructing``: the object being built; the ``__init__`` frames of its own class (a
    DataLoader subclass's constructor handing on to DataLoader's) are not where it was built,
    the call of the class is. ``instance`` is a weak reference to the ``self`` of the site's
    method (the LightningModule or datamodule whose ``train_dataloader`` built the loader), or None.
    """
    site: CodeSite | None = None
    instance: Any = None
    inner: list[str] = []
    outer: list[str] = []
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        package = str(frame.f_globals.get("__name__", "")).split(".")[0]
        framework = FRAMEWORKS.get(package)
        code = frame.f_code
        if framework is not None:
            found = outer if site is not None else inner
            if framework not in found:
                found.append(framework)
        elif site is None and package not in LIBRARIES and not _constructor_of(frame, constructing):
            # "Classifier.train_dataloader", not "make_module.<locals>.Classifier.train_dataloader".
            function = getattr(code, "co_qualname", code.co_name).rsplit("<locals>.", 1)[-1]
            site = {"file": code.co_filename, "function": function, "line": frame.f_lineno,
                    "cell": notebook_cell(code.co_filename)}
            instance = _self_of(frame)
        frame = frame.f_back
    return {"site": site, "inner": inner, "outer": outer, "instance": instance}


def _constructor_of(frame: FrameType, constructing: Any) -> bool:
    """``frame`` runs an ``__init__`` of ``constructing`` (read once per loader, never per batch)."""
    code = frame.f_code
    if constructing is None or code.co_name != "__init__" or not code.co_argcount:
        return False
    return frame.f_locals.get(code.co_varnames[0]) is constructing


def _self_of(frame: FrameType) -> Any:
    """A weak reference to the ``self`` of a method's frame, or None."""
    code = frame.f_code
    if not code.co_argcount or code.co_varnames[0] != "self":
        return None
    try:
        return weakref.ref(frame.f_locals["self"])
    except (KeyError, TypeError):
        return None


def user_names(loader: Any, names: Mapping[int, str], built: Origin | None) -> dict[str, str]:
    """The user's names for what a rebuilt loader must keep: its class (a DataLoader subclass),
    its ``collate_fn``, ``batch_sampler`` and ``sampler``; and ``built_by``, the object whose method
    built it (``model`` for a LightningModule's ``train_dataloader``). Only those a name holds."""
    from torch.utils.data import DataLoader

    found: dict[str, str] = {}
    objects = {"class": type(loader) if type(loader) is not DataLoader else None,
               "collate_fn": getattr(loader, "collate_fn", None),
               "batch_sampler": getattr(loader, "batch_sampler", None),
               "sampler": getattr(loader, "sampler", None)}
    reference = (built or NO_ORIGIN).get("instance")
    objects["built_by"] = reference() if reference is not None else None
    for role, value in objects.items():
        name = names.get(id(value)) if value is not None else None
        if name is not None:
            found[role] = name
    return found


def notebook_cell(file: str) -> int | None:
    """The execution number of the IPython cell compiled under ``file``, or None (a real file)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    mapping = getattr(getattr(shell, "compile", None), "_filename_map", None)
    return mapping.get(file) if isinstance(mapping, dict) else None


def display_path(file: str) -> str:
    """``file`` relative to the working directory (a notebook's kernel runs in the notebook's
    folder) where it lies under it, else as it is."""
    try:
        relative = os.path.relpath(file)
    except ValueError:  # another drive (Windows)
        return file
    return file if relative.startswith(os.pardir) else relative


def _cell_file(file: str) -> bool:
    """``file`` is one ipykernel compiled a cell under (``<tmp>/ipykernel_<pid>/<hash>.py``), or IPython's
    own ``<ipython-input-...>`` name: no file of the user's, whatever its name says."""
    return file.startswith("<ipython-input-") or os.path.basename(os.path.dirname(file)).startswith("ipykernel_")


def location(site: CodeSite) -> str:
    """Where code is, in the user's terms, the one way every finding, comment and table says it:
    ``cell In [7], line 26`` for a notebook cell (its number as the prompt shows it),
    ``data/loaders.py, line 12`` for a file (relative to the working directory). ``site`` has ``file``
    and ``line``, and ``cell`` where it was read in the kernel (else it is looked up now)."""
    file = str(site.get("file") or "")
    cell = site.get("cell")
    if cell is None and file:
        cell = notebook_cell(file)
    if cell is not None:
        where = f"cell In [{cell}]"
    elif _cell_file(file):
        where = "a notebook cell"  # one whose number IPython no longer knows (another kernel's)
    else:
        where = display_path(file) if file else "unknown file"
    return f"{where}, line {site.get('line')}"


def place(site: CodeSite) -> str:
    """The site with its function: ``in make_loader() (loaders.py, line 12)``, ``in train() (cell In [5],
    line 3)``, or ``at line 3 of cell In [5]`` for a cell's or script's own top level."""
    if site.get("function") in ("<module>", None):
        where, line = location(site).rsplit(", line ", 1)
        return f"at line {line} of {where}"
    return f"in {site['function']}() ({location(site)})"


def history_site(namespace: Mapping[str, Any] | None, name: str,
                 classes: Collection[str] = ()) -> CodeSite | None:
    """Where the notebook's latest cell assigning ``name`` at its top level built it with
    ``DataLoader(...)`` (or one of ``classes``): the site of a loader built before the watch began
    (the probe sees only those built during it). None outside IPython, when that cell assigned
    ``name`` otherwise, or when its source is gone."""
    cells = (namespace or {}).get("_ih")
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    mapping = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if not isinstance(cells, list) or not isinstance(mapping, dict):
        return None
    files = {number: file for file, number in mapping.items()}
    callees = {*classes, "DataLoader"}
    for number in range(len(cells) - 1, 0, -1):
        try:
            tree = ast.parse(cells[number])  # IPython's own translation: magics are calls
        except (SyntaxError, TypeError, ValueError):
            continue
        assigned = [node for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(bound, ast.Name) and bound.id == name
                            for target in node.targets for bound in ast.walk(target))]
        if not assigned:
            continue
        last = assigned[-1]
        value = last.value
        plain = any(isinstance(target, ast.Name) and target.id == name for target in last.targets)
        if not (plain and isinstance(value, ast.Call) and _called_name(value) in callees) or number not in files:
            return None
        return {"file": files[number], "function": "<module>", "line": value.lineno, "cell": number}
    return None


def placed(loaders: list[Any], namespace: Mapping[str, Any] | None) -> list[Any]:
    """``loaders`` (LoaderFacts), a named one built before the watch given its site from the
    notebook's history (:func:`history_site`)."""
    for facts in loaders:
        if facts.get("built_at") is None and facts.get("name"):
            constructor = (facts.get("settings") or {}).get("constructor") or {}
            classes = [constructor["class_name"]] if constructor.get("class_name") else []
            facts["built_at"] = history_site(namespace, facts["name"], classes)
    return loaders


def owner(built: Origin | None, iterated: Origin | None) -> str | None:
    """The framework that owns the loader: "transformers", "accelerate", "lightning" or None."""
    built_inner = (built or NO_ORIGIN).get("inner") or []
    built_outer = (built or NO_ORIGIN).get("outer") or []
    iterated_inner = (iterated or NO_ORIGIN).get("inner") or []
    iterated_outer = (iterated or NO_ORIGIN).get("outer") or []
    if "transformers" in built_inner:
        return "transformers"
    if "accelerate" in built_inner or "accelerate" in iterated_inner:
        return "accelerate"
    if "lightning" in built_outer or "lightning" in iterated_outer:
        return "lightning"
    return None


def framework_names(namespace: Mapping[str, Any] | None) -> dict[str, str]:
    """role -> the user's name for a Trainer, TrainingArguments, Accelerator in the namespace."""
    found: dict[str, str] = {}
    for name, value in (namespace or {}).items():
        if name.startswith("_"):
            continue
        for cls in type(value).__mro__:
            role = FRAMEWORK_OBJECTS.get((cls.__module__, cls.__name__))
            if role is not None:
                found.setdefault(role, name)
                break
    return found


def wrapped_loaders(namespace: Mapping[str, Any] | None) -> dict[int, str]:
    """id(inner DataLoader) -> the user's name for the object wrapping it (accelerate's
    prepared loaders delegate to a plain DataLoader, ``base_dataloader``, which is what runs)."""
    found: dict[int, str] = {}
    for name, value in (namespace or {}).items():
        if name.startswith("_"):
            continue
        base = _base_dataloader(value)
        if base is not None:
            found.setdefault(id(base), name)
    return found


def _base_dataloader(value: Any) -> Any:
    try:
        return vars(value).get("base_dataloader") if hasattr(value, "__dict__") else None
    except TypeError:
        return None


def shards_by_worker(dataset: Any, worker_init_fn: Any = None) -> bool | None:
    """For an IterableDataset: does it split its items between worker processes?

    torch gives every worker a full copy of an IterableDataset; unless ``__iter__`` (or the
    loader's ``worker_init_fn``) reads ``get_worker_info()``, each worker yields every item.
    True/False from the source; None when the source cannot be read.
    """
    sources = []
    for function in (getattr(type(dataset), "__iter__", None), worker_init_fn):
        if function is None:
            continue
        try:
            sources.append(inspect.getsource(function))
        except (OSError, TypeError):
            return None
    return any("get_worker_info" in source for source in sources)


def code_location(function: Any) -> CodeSite | None:
    """file, function and first line of ``function``'s source, or None (built-in, C code)."""
    try:
        lines, line = inspect.getsourcelines(function)
        file = inspect.getsourcefile(function)
    except (OSError, TypeError):
        return None
    if file is None:
        return None
    return {"file": file, "function": getattr(function, "__qualname__", str(function)), "line": line,
            "cell": notebook_cell(file)}


def dataset_facts(dataset: Any) -> LoaderSettings:
    """Where the dataset builds a sample, and which of its attributes hold per-sample transforms."""
    from torch.utils.data import IterableDataset

    method = "__iter__" if isinstance(dataset, IterableDataset) else "__getitem__"
    transforms = [name for name in TRANSFORM_ATTRIBUTES if callable(getattr(dataset, name, None))]
    return {"dataset_code": code_location(getattr(type(dataset), method, None)),
            "dataset_transforms": transforms}


def call_with_keywords(site: CodeSite, keywords: Mapping[str, int | float | bool | str | None],
                       classes: Collection[str] = ()) -> str | None:
    """The source of the ``DataLoader(...)`` call (or of one of ``classes``, the loader's own class)
    at ``site`` with ``keywords`` set (added or replaced), as one line; None when the source cannot
    be read or holds no such call."""
    call = _call_at(site, classes)
    if call is None:
        return None
    kept = [keyword for keyword in call.keywords if keyword.arg not in keywords]
    call.keywords = kept + [ast.keyword(arg=key, value=ast.Constant(value)) for key, value in keywords.items()]
    return ast.unparse(call)


def call_arguments(site: CodeSite, classes: Collection[str] = ()) -> tuple[int, set[str]] | None:
    """(positional arguments, keyword names) of the loader's call at ``site``; None when it cannot
    be read or passes ``*args`` or ``**kwargs`` (which arguments they hold is not in the source)."""
    call = _call_at(site, classes)
    if call is None or any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    return len(call.args), {k.arg for k in call.keywords if k.arg is not None}


def _call_at(site: CodeSite, classes: Collection[str]) -> ast.Call | None:
    """The innermost call of ``DataLoader`` or one of ``classes`` on the line ``site`` names."""
    tree = parse_source(site["file"])
    if tree is None:
        return None
    line = site["line"]
    names = {*classes, "DataLoader"}
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and node.lineno <= line <= (node.end_lineno or node.lineno)
             and (_called_name(node).endswith("DataLoader") or _called_name(node) in names)]
    if not calls:
        return None
    return max(calls, key=lambda node: (node.lineno, node.col_offset))  # the innermost


def parse_source(file: str) -> ast.Module | None:
    """The syntax tree of ``file`` as ``linecache`` holds it (IPython registers each cell's source
    there), or None when there is no source or it does not parse."""
    source = "".join(linecache.getlines(file))
    if not source:
        return None
    try:
        return ast.parse(source)
    except SyntaxError:
        # A notebook cell keeps IPython's magic lines (%%gpuwatch): blank them, keep numbering.
        lines = ["\n" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines(True)]
        try:
            return ast.parse("".join(lines))
        except SyntaxError:
            return None


def _called_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""
