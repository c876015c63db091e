"""How a DataLoader of the user's own class is built again: what its constructor hands on to DataLoader.

A change to a loader's speed settings must keep the user's class: a subclass whose ``__iter__``
yields dict batches, or that sets its own collate function, does what a plain DataLoader would
not. :func:`constructor_facts` reads the subclass's ``__init__`` once per loader, never per
batch: its signature and its ``super().__init__(...)`` call (from the source, with ``ast``), so
it knows which DataLoader arguments the constructor takes and under which of its own parameter
names, which it sets itself, and from which attribute the value of each of its own parameters
can be read back (``self.tokenizer = tokenizer``). :func:`constructor_call` plans a call from
those facts; the code a finding shows and the tuner's rebuilt loader both use it, so they
cannot disagree on what the class accepts.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Generic, TypeVar, cast

from gpuwidget.facts import CodeSite, LoaderChange, LoaderConstructor
from gpuwidget.probes.origin import call_arguments, code_location

V = TypeVar("V")  # what a keyword argument is: a value, or the expression that gives it


@cache
def dataloader_parameters() -> tuple[tuple[str, ...], frozenset[str]]:
    """torch's DataLoader.__init__ parameters: (positional-or-keyword in order, keyword-only)."""
    from torch.utils.data import DataLoader

    # inspect.signature follows __wrapped__, so the probe's wrapper shows torch's own signature.
    parameters = list(inspect.signature(DataLoader.__init__).parameters.values())[1:]
    positional = tuple(p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD)
    keyword_only = frozenset(p.name for p in parameters if p.kind is p.KEYWORD_ONLY)
    return positional, keyword_only


def constructor_facts(loader: Any) -> LoaderConstructor | None:
    """What ``type(loader)``'s constructor takes, as plain data; None for torch's DataLoader itself."""
    from torch.utils.data import DataLoader

    cls = type(loader)
    if cls is DataLoader or not isinstance(loader, DataLoader):
        return None
    facts: LoaderConstructor = {"class_name": cls.__name__}
    owners = [klass for klass in cls.__mro__ if "__init__" in vars(klass)]
    if owners[0] is DataLoader:
        positional, keyword_only = dataloader_parameters()
        everything = {name: name for name in (*positional, *sorted(keyword_only)) if name != "dataset"}
        return cast(LoaderConstructor, {**facts, "known": True, "dataset": "positional", "keywords": everything,
                                        "fixed": [], "attributes": {}, "defaults": {}, "missing": []})
    init = inspect.unwrap(vars(owners[0])["__init__"])
    facts["code"] = code_location(init)
    if len(owners) < 2 or owners[1] is not DataLoader:
        return cast(LoaderConstructor, {**facts, "known": False,
                                        "reason": "its __init__ hands its arguments to another class's __init__"})
    try:
        read = _read_init(init, loader)
    except _Unreadable as why:
        return cast(LoaderConstructor, {**facts, "known": False, "reason": str(why)})
    except Exception:  # noqa: BLE001 - read at the user's first iteration: never break their loop
        return cast(LoaderConstructor, {**facts, "known": False, "reason": "its __init__ cannot be read"})
    return cast(LoaderConstructor, {**facts, "known": True, **read})


class _Unreadable(Exception):
    """The constructor's hand-over to DataLoader cannot be read; the message says why."""


def _read_init(init: Any, loader: Any) -> LoaderConstructor:
    try:
        source = textwrap.dedent(inspect.getsource(init))
        function = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        raise _Unreadable("its __init__'s source cannot be read") from None
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise _Unreadable("its __init__'s source cannot be read")
    parameters = list(inspect.signature(init).parameters.values())
    self_name, own = parameters[0].name, parameters[1:]
    var_positional = next((p.name for p in own if p.kind is p.VAR_POSITIONAL), None)
    var_keyword = next((p.name for p in own if p.kind is p.VAR_KEYWORD), None)
    named = {p.name: p for p in own if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    call = _handover(function, self_name)
    positional, keyword_only = dataloader_parameters()

    bound: dict[str, ast.expr] = {}  # DataLoader parameter -> the expression the call gives it
    star_at: int | None = None
    for index, argument in enumerate(call.args):
        if isinstance(argument, ast.Starred):
            if not (isinstance(argument.value, ast.Name) and argument.value.id == var_positional) \
                    or index != len(call.args) - 1:
                raise _Unreadable("its __init__ hands DataLoader positional arguments that cannot be followed")
            star_at = index
        elif index < len(positional):
            bound[positional[index]] = argument
        else:
            raise _Unreadable("its __init__ hands DataLoader more positional arguments than it takes")
    forwards_keywords = False
    for keyword in call.keywords:
        if keyword.arg is None:
            if not (isinstance(keyword.value, ast.Name) and keyword.value.id == var_keyword):
                raise _Unreadable("its __init__ hands DataLoader keyword arguments that cannot be followed")
            forwards_keywords = True
        else:
            bound[keyword.arg] = keyword.value

    keywords: dict[str, str] = {}  # DataLoader parameter -> the constructor's parameter that takes it
    fixed: list[str] = []
    for parameter, expression in bound.items():
        if isinstance(expression, ast.Name) and expression.id in named:
            keywords[parameter] = expression.id
        else:
            fixed.append(parameter)
    if forwards_keywords:
        for parameter in (*positional, *sorted(keyword_only)):
            if parameter not in bound and parameter not in named:
                keywords[parameter] = parameter
    passed_on = set(keywords.values())
    dataset = _dataset_mode(keywords, fixed, star_at, own, named)
    if dataset is None:
        raise _Unreadable("its __init__ does not hand a dataset to DataLoader in a way that can be followed")
    if dataset == "positional":
        keywords.pop("dataset", None)
    # Keyword passing only: a positional-only parameter cannot take a DataLoader argument by name.
    keywords = {key: taker for key, taker in keywords.items()
                if taker not in named or named[taker].kind is not inspect.Parameter.POSITIONAL_ONLY}

    attributes: dict[str, str] = {}
    defaults: dict[str, int | None] = {}
    missing: list[str] = []
    assigned = _assigned_attributes(function, self_name)
    state = vars(loader)
    for index, own_parameter in enumerate(own):
        name = own_parameter.name
        if name not in named or name in passed_on:
            continue
        attribute = assigned.get(name)
        if attribute is not None and attribute in state:
            attributes[name] = attribute
        elif own_parameter.default is not own_parameter.empty:
            # Its default holds unless the call that built the loader passed it (checked there).
            defaults[name] = index if own_parameter.kind is own_parameter.POSITIONAL_OR_KEYWORD else None
        else:
            missing.append(name)
    return {"dataset": dataset, "keywords": keywords, "fixed": fixed, "attributes": attributes,
            "defaults": defaults, "missing": missing}


def _handover(function: ast.FunctionDef | ast.AsyncFunctionDef, self_name: str) -> ast.Call:
    """The one ``super().__init__(...)`` (or ``DataLoader.__init__(self, ...)``) call, with ``self`` removed."""
    calls = []
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__"):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            calls.append(node)
        elif (isinstance(owner, (ast.Name, ast.Attribute)) and ast.unparse(owner).endswith("DataLoader")
              and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == self_name):
            calls.append(ast.Call(func=node.func, args=node.args[1:], keywords=node.keywords))
    if len(calls) != 1:
        raise _Unreadable("its __init__ does not call DataLoader's __init__ exactly once")
    return calls[0]


def _dataset_mode(keywords: Mapping[str, str], fixed: list[str], star_at: int | None, own: list[inspect.Parameter],
                  named: Mapping[str, inspect.Parameter]) -> str | None:
    """How a rebuilt call gives the dataset: "positional", by the keyword of the parameter that
    takes it, "fixed" (the constructor makes its own), or None (it cannot be followed)."""
    if star_at == 0:
        return "positional"  # through *args
    if "dataset" in keywords:
        taker = named.get(keywords["dataset"])
        if taker is None:
            return "dataset"  # through **kwargs
        if own and own[0] is taker and taker.kind in (taker.POSITIONAL_ONLY, taker.POSITIONAL_OR_KEYWORD):
            return "positional"
        return taker.name if taker.kind is not taker.POSITIONAL_ONLY else None
    return "fixed" if "dataset" in fixed else None


def _assigned_attributes(function: ast.FunctionDef | ast.AsyncFunctionDef, self_name: str) -> dict[str, str]:
    """parameter -> attribute, for each plain ``self.attribute = parameter`` in the constructor."""
    found: dict[str, str] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            for target in node.targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == self_name):
                    found.setdefault(node.value.id, target.attr)
    return found


@dataclass
class ConstructorCall(Generic[V]):
    """A planned call of the loader's class: the dataset (positional, by a keyword, or left to the
    constructor), keyword arguments under the constructor's names, and its own parameters to read
    back from the old loader's attributes."""

    dataset: Any = None
    dataset_keyword: str | None = None  # None: positional (or "fixed": not passed)
    keywords: dict[str, V] = field(default_factory=dict)
    attributes: dict[str, str] = field(default_factory=dict)  # parameter -> attribute of the old loader
    defaults: dict[str, int | None] = field(default_factory=dict)  # own parameters left to their default


def constructor_call(constructor: LoaderConstructor | None, arguments: Mapping[str, V],
                     changed: Collection[str]) -> ConstructorCall[V] | str:
    """The call that builds the loader again with DataLoader ``arguments`` (``dataset`` included),
    or why the class cannot take them (a sentence starting "its __init__ ...").

    An argument the constructor sets itself is left to it, unless it is one of ``changed``
    (the speed settings being changed): then the class cannot apply the change.
    """
    if not constructor:
        return ConstructorCall(dataset=arguments.get("dataset"),
                               keywords={k: v for k, v in arguments.items() if k != "dataset"})
    if not constructor.get("known"):
        return str(constructor.get("reason") or "its __init__ cannot be read")
    missing = constructor.get("missing") or []
    if missing:
        listed = ", ".join(missing)
        return f"its __init__ needs {listed}, which no attribute of the loader keeps"
    call: ConstructorCall[V] = ConstructorCall(attributes=dict(constructor.get("attributes") or {}),
                           defaults=dict(constructor.get("defaults") or {}))
    mode = constructor.get("dataset")
    if mode != "fixed":
        call.dataset = arguments.get("dataset")
        call.dataset_keyword = None if mode == "positional" else mode
    keywords = constructor_keywords(constructor, arguments, changed)
    if isinstance(keywords, str):
        return keywords
    call.keywords = keywords
    return call


def constructor_keywords(constructor: LoaderConstructor, arguments: Mapping[str, V],
                         changed: Collection[str]) -> dict[str, V] | str:
    """DataLoader ``arguments`` (but the dataset) under the names the constructor takes them by,
    or why it cannot take them (see :func:`constructor_call`)."""
    takes = constructor.get("keywords") or {}
    fixed = constructor.get("fixed") or []
    keywords: dict[str, V] = {}
    for key, value in arguments.items():
        if key == "dataset":
            continue
        if key in takes:
            keywords[takes[key]] = value
        elif key in fixed and key not in changed:
            continue  # the constructor sets it again itself, as it did
        elif key in fixed:
            return f"its __init__ sets {key} itself"
        else:
            return f"its __init__ does not pass {key} on to DataLoader"
    return keywords


def rebuild_loader(loader: Any, change: LoaderChange | None = None, built_at: CodeSite | None = None) -> Any:
    """A new loader of ``loader``'s own class over the same data, with ``change`` applied.

    Raises ``TypeError`` naming what the class's constructor lacks when it cannot take them, or
    when one of its own parameters was left to its default and ``built_at`` (the user's call that
    built the loader, as a watch records it) does not show that the call left it so.
    """
    from torch.utils.data import DataLoader

    from gpuwidget.probes.torch_data import loader_kwargs

    change = LoaderChange(**change) if change else LoaderChange()
    arguments = loader_kwargs(loader, change)
    constructor = constructor_facts(loader)
    if constructor is None:
        return DataLoader(**arguments)
    plan = constructor_call(constructor, _non_default(arguments, loader), change)
    if isinstance(plan, str):
        raise TypeError(f"{type(loader).__name__} cannot be built again with {change}: {plan}")
    if plan.defaults and not defaults_hold(plan.defaults, built_at, constructor.get("class_name", "")):
        raise TypeError(f"{type(loader).__name__} cannot be built again with {change}: its __init__ takes "
                        f"{', '.join(plan.defaults)}, whose values the loader does not keep")
    keywords = {**plan.keywords, **{p: getattr(loader, a) for p, a in plan.attributes.items()}}
    if plan.dataset_keyword is not None:
        keywords[plan.dataset_keyword] = plan.dataset
    positional = [plan.dataset] if constructor.get("dataset") == "positional" else []
    return type(loader)(*positional, **keywords)


def _non_default(arguments: Mapping[str, object], loader: Any) -> dict[str, object]:
    """The DataLoader ``arguments`` a constructor must be given: those that differ from what
    DataLoader does by default, a plain sampler written as ``shuffle`` (a subclass seldom takes
    ``sampler=``, and a fresh RandomSampler draws the same order from the same RNG state)."""
    from torch.utils.data import DataLoader, RandomSampler
    from torch.utils.data._utils.collate import default_collate

    from gpuwidget.probes.torch_data import _plain_sampler as plain_sampler

    defaults = {name: p.default for name, p in inspect.signature(DataLoader.__init__).parameters.items()}
    kept: dict[str, object] = {}
    for key, value in arguments.items():
        if key == "sampler" and value is not None and plain_sampler(value):
            if isinstance(value, RandomSampler):
                kept["shuffle"] = True
            continue
        if key == "collate_fn" and value is default_collate:
            continue
        if key in defaults and key != "dataset" and _equal(value, defaults[key]):
            continue
        kept[key] = value
    return kept


def _equal(value: Any, default: Any) -> bool:
    try:
        return bool(value is default or (type(value) is type(default) and value == default))
    except Exception:  # noqa: BLE001 - an object whose == misbehaves is not a default
        return False


def defaults_hold(defaults: Mapping[str, int | None], built_at: CodeSite | None, class_name: str) -> bool:
    """Did the call at ``built_at`` leave each of ``defaults`` (parameter -> its position among the
    constructor's parameters, None for keyword-only) to its default? False when it cannot be read."""
    if built_at is None:
        return False
    passed = call_arguments(built_at, {class_name})
    if passed is None:
        return False
    count, names = passed
    return not any(name in names or (index is not None and index < count) for name, index in defaults.items())
