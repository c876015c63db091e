"""The server's wire payloads: gpuwidget/server/protocol.py is labextension/src/protocol.ts, and the server sends it.

protocol.ts's interfaces are read from its source (as the history's columns are in
test_server_stream.py) and compared with protocol.py's TypedDicts, key for key: which keys
there are, which the server may leave out, the string literals of the messages' ``type``, and
which interfaces a key's value is made of. The client's parse functions fill in what an older
server leaves out, so a key the client treats as optional may be one the server always sends,
never the other way round. Then the server's own payloads (a Monitor over a fake NVML, the
cluster route over a fake Prometheus) are checked against the TypedDicts.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import time
import types
import typing
import urllib.parse
from pathlib import Path

import pytest
from tornado.httpclient import HTTPRequest, HTTPResponse

from gpuwidget.server import protocol

from fakenvml import FakeNvml

PROTOCOL_TS = Path(__file__).parents[1] / "labextension" / "src" / "protocol.ts"


# ------------------------------------------------------------------------------- protocol.ts, read


def _without_comments(source: str) -> str:
    source = re.sub(r"/\*.*?\*/", "", source, flags=re.S)
    return re.sub(r"//[^\n]*", "", source)


def ts_interfaces(source: str) -> dict[str, dict[str, tuple[bool, str]]]:
    """interface name -> field -> (optional, its type's text), of every ``export interface`` in ``source``."""
    found = {}
    for name, body in re.findall(r"export interface (\w+)\s*\{([^{}]*)\}", _without_comments(source)):
        fields = {}
        for declaration in body.split(";"):
            match = re.fullmatch(r"\s*(\w+)(\??)\s*:\s*(.+?)\s*", declaration, flags=re.S)
            if match:
                fields[match.group(1)] = (match.group(2) == "?", " ".join(match.group(3).split()))
        found[name] = fields
    return found


def ts_aliases(source: str) -> dict[str, str]:
    """type alias -> its text (``StaleDevices`` -> ``Record<string, IStaleDevice>``)."""
    return {name: " ".join(text.split())
            for name, text in re.findall(r"export type (\w+)\s*=\s*([^;]+);", _without_comments(source))}


def _expanded(text: str, aliases: dict[str, str], depth: int = 3) -> str:
    for _ in range(depth):
        text = re.sub(r"\b\w+\b", lambda word: f"({aliases[word.group(0)]})" if word.group(0) in aliases
                      else word.group(0), text)
    return text


# ------------------------------------------------------------------------------- protocol.py, read


def py_typeddicts(module: types.ModuleType) -> dict[str, type]:
    """The public TypedDicts of ``module``, by name."""
    return {name: value for name, value in vars(module).items()
            if isinstance(value, type) and typing.is_typeddict(value) and not name.startswith("_")
            and value.__module__ == module.__name__}


def _flattened(hint: object) -> list[object]:
    """The members of a union, recursively, and the arguments of generics (list[X] -> X)."""
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return [hint]
    if arguments:
        return [hint, *(member for argument in arguments for member in _flattened(argument))]
    return [hint]


def _literals(hint: object) -> set[str]:
    return {value for member in _flattened(hint) if typing.get_origin(member) is typing.Literal
            for value in typing.get_args(member) if isinstance(value, str)}


def _referenced(hint: object) -> set[str]:
    return {member.__name__ for member in _flattened(hint)
            if isinstance(member, type) and typing.is_typeddict(member)}


# ------------------------------------------------------------------------------- the comparison


def differences(source: str, module: types.ModuleType) -> list[str]:
    """Every way ``module``'s TypedDicts and ``source``'s interfaces disagree, in words; [] when they are equal."""
    interfaces, aliases = ts_interfaces(source), ts_aliases(source)
    dicts = py_typeddicts(module)
    found = []
    for name in sorted(set(interfaces) - {f"I{py}" for py in dicts}):
        found.append(f"{name} has no TypedDict {name[1:]} in protocol.py")
    for name in sorted(set(dicts) - {ts[1:] for ts in interfaces}):
        found.append(f"{name} has no interface I{name} in protocol.ts")
    for ts_name, fields in sorted(interfaces.items()):
        py_type = dicts.get(ts_name[1:])
        if py_type is None:
            continue
        hints = typing.get_type_hints(py_type)
        required = py_type.__required_keys__  # type: ignore[attr-defined]
        for key in sorted(set(fields) - set(hints)):
            found.append(f"{ts_name}.{key} is missing from {py_type.__name__}")
        for key in sorted(set(hints) - set(fields)):
            found.append(f"{py_type.__name__}.{key} is missing from {ts_name}")
        for key in sorted(set(fields) & set(hints)):
            optional, text = fields[key]
            where = f"{ts_name}.{key}"
            if not optional and key not in required:
                found.append(f"{where}: the client needs it, the server may leave it out")
            ts_literals = set(re.findall(r"'([^']*)'", text))
            if ts_literals != _literals(hints[key]):
                found.append(f"{where}: string literals {sorted(ts_literals)} vs {sorted(_literals(hints[key]))}")
            ts_refs = {ref[1:] for ref in re.findall(r"\bI[A-Z]\w*", _expanded(text, aliases)) if ref in interfaces}
            if ts_refs != _referenced(hints[key]):
                found.append(f"{where}: made of {sorted(ts_refs)} vs {sorted(_referenced(hints[key]))}")
            if re.search(r"\bnull\b", _expanded(text, aliases)) and type(None) not in _flattened(hints[key]):
                found.append(f"{where}: may be null in protocol.ts, never None in protocol.py")
    return found


def test_protocol_py_is_protocol_ts_key_for_key():
    source = PROTOCOL_TS.read_text(encoding="utf-8")
    assert len(ts_interfaces(source)) >= 15  # the reader found the interfaces, not an empty file
    assert differences(source, protocol) == []


def test_the_comparison_names_each_kind_of_disagreement():
    source = PROTOCOL_TS.read_text(encoding="utf-8")
    planted = (source.replace("  gpu_found: boolean;", "  gpu_found?: boolean;")  # required -> optional: allowed
               .replace("  hung: boolean;", "")  # a key the client lost
               .replace("  type: 'sample';", "  type: 'samples';")  # another literal
               .replace("  stale?: StaleDevices;\n}\n\n/**\n * What the charts", "  stale?: number;\n}\n\n/**\n"
                        " * What the charts")  # not made of IStaleDevice any more
               .replace("export interface IHostInfo {", "export interface IHostInfo {\n  load: number;")
               .replace("  pid: number | null;", "  pid: number | null;\n  cwd?: string | null;"))
    assert planted.count("stale?: number;") == 1
    found = differences(planted, protocol)
    assert found == [
        "IHelloMessage.stale: made of [] vs ['StaleDevice']",
        "IHostInfo.load is missing from HostInfo",
        "IProcessInfo.cwd is missing from ProcessInfo",
        "ISampleMessage.type: string literals ['samples'] vs ['sample']",
        "StaleDevice.hung is missing from IStaleDevice",
    ]


def test_a_key_the_client_needs_and_the_server_may_leave_out_is_named():
    source = PROTOCOL_TS.read_text(encoding="utf-8").replace("  vendor?: string;", "  vendor: string;")
    assert differences(source, protocol) == ["IDeviceInfo.vendor: the client needs it, the server may leave it out"]


def test_a_value_the_client_takes_as_null_is_none_in_python_too():
    source = PROTOCOL_TS.read_text(encoding="utf-8").replace("  serial?: string | null;", "  serial?: string;")
    assert differences(source, protocol) == []  # None where the client expects none: its parse copes
    fake = types.ModuleType("fake_protocol")
    exec("from typing import TypedDict\nclass ProcessInfo(TypedDict):\n    pid: int\n", fake.__dict__)
    only = "export interface IProcessInfo {\n  pid: number | null;\n}\n"
    assert differences(only, fake) == ["IProcessInfo.pid: may be null in protocol.ts, never None in protocol.py"]


# ------------------------------------------------------------------------------- what the server sends


def conforms(value: object, hint: object, where: str = "payload") -> list[str]:
    """Every place ``value`` (parsed JSON) does not have the shape ``hint`` says; [] when it does."""
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any or hint is object:
        return []
    if hint is type(None):
        return [] if value is None else [f"{where}: {value!r} is not null"]
    if origin in (typing.Union, types.UnionType):
        tried = [conforms(value, member, where) for member in arguments]
        return [] if any(not found for found in tried) else min(tried, key=len)
    if origin is typing.Literal:
        return [] if value in arguments else [f"{where}: {value!r} is not one of {arguments}"]
    if isinstance(hint, type) and typing.is_typeddict(hint):
        if not isinstance(value, dict):
            return [f"{where}: {value!r} is not an object"]
        hints = typing.get_type_hints(hint)
        found = [f"{where}: no {key!r}" for key in sorted(hint.__required_keys__ - set(value))]  # type: ignore
        found += [f"{where}: {key!r} is not in {hint.__name__}" for key in sorted(set(value) - set(hints))]
        for key in sorted(set(value) & set(hints)):
            found += conforms(value[key], hints[key], f"{where}.{key}")
        return found
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: {value!r} is not a list"]
        return [problem for index, item in enumerate(value) for problem in conforms(item, arguments[0],
                                                                                    f"{where}[{index}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: {value!r} is not an object"]
        return [problem for key, item in value.items() for problem in conforms(item, arguments[1], f"{where}.{key}")]
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)  # type: ignore[arg-type]
    return [] if ok else [f"{where}: {value!r} is not {getattr(hint, '__name__', hint)}"]


def test_the_shape_check_names_what_a_payload_lacks_or_adds():
    assert conforms({"cpu_count": 2, "mem_total": None}, protocol.HostInfo) == []
    assert conforms({"cpu_count": "2", "swap": 1}, protocol.HostInfo) == [
        "payload: no 'mem_total'", "payload: 'swap' is not in HostInfo", "payload.cpu_count: '2' is not int"]
    assert conforms({"type": "hello", "devices": {}}, protocol.HistoryMessage) != []


@pytest.fixture
def monitor(fake_nvml):
    from gpuwidget.server.monitor import Monitor

    fake = FakeNvml.gpus(2)
    fake.processes(0, compute=[(1, 2**30)])
    fake_nvml(fake)
    monitor = Monitor(interval=0.05)
    yield monitor
    monitor.close()


def test_the_monitors_payloads_are_the_protocols(monitor):
    from gpuwidget.server.monitor import _Stale

    assert conforms(monitor.devices(), protocol.DevicesReply) == []
    assert len(monitor.devices()["devices"]) == 2
    monitor.read_once()
    monitor.read_once()
    latest = monitor.latest()
    assert conforms(latest, protocol.Latest) == [] and "gpu0.util" in latest["values"]
    assert conforms(monitor.history(), protocol.History) == []
    # A GPU that stopped answering: what the hello, the samples and the snapshot say of it.
    monitor._stalled["GPU 1"] = time.time() - 3
    monitor._stale["gpu1"] = _Stale("GPU 1", True, time.time() - 3, {"gpu1.util": 40.0, "gpu1.power": None})
    hello = json.loads(monitor.hello_text())
    assert conforms(hello, protocol.HelloMessage) == [] and hello["stale"]["gpu1"]["hung"] is True
    history = json.loads(monitor.history_text())
    assert conforms(history, protocol.HistoryMessage) == [] and history["t"]
    monitor._list_processes(latest["t"])
    processes = json.loads(monitor.processes_text())
    assert conforms(processes, protocol.ProcessesMessage) == [] and processes["gpus"]["gpu0"]
    sent: list[str] = []
    token = monitor.subscribe(sent.append)
    try:
        deadline = time.monotonic() + 10
        while not any('"sample"' in text for text in sent):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        monitor.unsubscribe(token)
    sample = json.loads(next(text for text in sent if '"sample"' in text))
    assert conforms(sample, protocol.SampleMessage) == [] and sample["stalled"][0]["source"] == "GPU 1"


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"gpuwidget": True}}, "GpuWidget": {"interval": 0.05}}


@pytest.mark.server
async def test_the_routes_bodies_are_the_protocols(jp_fetch, jp_serverapp, fake_nvml):
    """/devices and /snapshot as a browser gets them, from a real Jupyter server over a fake NVML."""
    fake_nvml(FakeNvml.gpus(2))
    monitor = jp_serverapp.web_app.settings["gpuwidget_monitor"]
    monitor.close()  # forget sources built before the fake was installed
    try:
        devices = json.loads((await jp_fetch("gpuwidget", "api", "devices")).body)
        snapshot = json.loads((await jp_fetch("gpuwidget", "api", "snapshot", params={"window": "30"})).body)
    finally:
        monitor.close()
    assert conforms(devices, protocol.DevicesReply) == [] and devices["cluster"] is False
    assert [device["id"] for device in devices["devices"]] == ["gpu0", "gpu1"]
    assert conforms(snapshot, protocol.SnapshotReply) == [] and "gpu1.util" in snapshot["latest"]["values"]


def _range_reply(request: HTTPRequest) -> HTTPResponse:
    """Prometheus's answer to a range query: gpuwidget's series of one GPU at the query's second and third steps."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.url).query)
    start, step = float(query["start"][0]), float(query["step"][0])
    labels = {"Hostname": "node-a", "gpu": "0", "UUID": "GPU-1", "modelName": "H100", "kernel_id": "abc",
              "notebook": "train.ipynb"}
    series = [{"metric": labels, "values": [[start + step, "0.5"], [start + 2 * step, "0.75"]]}]
    if not query["query"][0].startswith("gpuwidget"):
        series = []  # no dcgm-exporter
    body = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": series}}).encode()
    return HTTPResponse(request, 200, buffer=io.BytesIO(body))


def test_the_cluster_replies_are_the_protocols():
    from gpuwidget.server.cluster import Cluster, PrometheusConfig

    async def fetch(request: HTTPRequest) -> HTTPResponse:
        return _range_reply(request)

    unconfigured = asyncio.run(Cluster(None).reply())
    assert conforms(unconfigured, protocol.ClusterReply) == [] and unconfigured["configured"] is False
    reply = asyncio.run(Cluster(PrometheusConfig(url="http://prometheus:9090"), fetch=fetch).reply(30, 15))
    assert conforms(json.loads(json.dumps(reply)), protocol.ClusterReply) == []
    [host] = reply["hosts"]
    assert reply["source"] == "gpuwidget" and host["gpus"][0]["holder"] == "train.ipynb"
    assert host["gpus"][0]["util"] == [None, 0.5, 0.75]  # 30 s at 15 s: three points
