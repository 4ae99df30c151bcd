"""What the operating system says about memory pressure, heat and process sizes.

Readers for the supervisor and the soak harness. Each takes its inputs (a
path, a callable returning command output or a raw value) as keyword
arguments with the real source as default, so the same parsing code runs
against fixtures in tests and against the machine in production.

    read_memory()    macOS  kern.memorystatus_vm_pressure_level (1/2/4)
                     Linux  /proc/pressure/memory (PSI) and psutil available memory, the worse wins
                     other  psutil available memory
    read_thermal()   macOS  com.apple.system.thermalpressurelevel (notify state) and `pmset -g therm`
                     Linux  /sys/class/thermal/thermal_zone*/ trip points and psutil.sensors_temperatures()
                     any    NVIDIA GPUs through NVML, when pynvml is importable
                     the worst source wins; "unavailable" when none could be read
    sample_processes(pids)  RSS per live pid

Nothing here imports MLX; psutil is the only dependency.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import psutil

Level = Literal["normal", "warning", "critical", "unavailable"]
ThermalLevel = Literal["nominal", "fair", "serious", "critical", "unavailable"]

MEMORY_LEVELS: tuple[Level, ...] = ("normal", "warning", "critical")
THERMAL_LEVELS: tuple[ThermalLevel, ...] = ("nominal", "fair", "serious", "critical")

# PSI "some avg10": % of the last 10 s in which at least one task stalled on memory (reclaim, refault).
DEFAULT_WARNING_PSI_AVG10 = 10.0
# PSI "full avg10": % of the last 10 s in which every runnable task stalled on memory: thrashing.
DEFAULT_CRITICAL_PSI_AVG10 = 10.0
DEFAULT_WARNING_AVAILABLE_FRACTION = 0.10
DEFAULT_CRITICAL_AVAILABLE_FRACTION = 0.05

MACOS_PRESSURE_SYSCTL = "kern.memorystatus_vm_pressure_level"
# kern.memorystatus_vm_pressure_level: the kernel's own dispatch levels (sys/kern_memorystatus.h).
MACOS_PRESSURE_LEVELS: dict[int, Level] = {1: "normal", 2: "warning", 4: "critical"}

MACOS_THERMAL_NOTIFY_NAME = "com.apple.system.thermalpressurelevel"
# OSThermalPressureLevel on macOS: nominal, moderate, heavy, trapping, sleeping.
MACOS_THERMAL_PRESSURE: dict[int, ThermalLevel] = {
    0: "nominal", 1: "fair", 2: "serious", 3: "critical", 4: "critical",
}
# IOPMGetThermalWarningLevel as `pmset -g therm` prints it: normal, danger/warning, crisis/trap.
PMSET_WARNING_LEVELS: dict[int, ThermalLevel] = {
    0: "nominal", 5: "serious", 100: "serious", 10: "critical", 110: "critical",
}
# CPU_Speed_Limit / CPU_Scheduler_Limit in %: below 100 the OS is throttling the CPU.
PMSET_CRITICAL_LIMIT_PCT = 50

# Within this many degrees of a GPU's slowdown temperature counts as "fair" (fans up, no throttling yet).
DEFAULT_GPU_FAIR_MARGIN_C = 10.0
# nvmlClocksEventReasons bits (nvml.h): which clock slowdowns are about heat.
NVML_HW_SLOWDOWN = 0x8
NVML_SW_THERMAL_SLOWDOWN = 0x20
NVML_HW_THERMAL_SLOWDOWN = 0x40


@dataclass(frozen=True)
class MemoryReading:
    """System memory pressure: a level, sizes in bytes, which signal decided, raw figures in `detail`."""

    level: Level
    total_bytes: int
    available_bytes: int
    source: str
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ThermalReading:
    """Thermal state: the worst level over every readable source, the hottest `celsius` seen."""

    level: ThermalLevel
    source: str
    celsius: float | None
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GpuThermal:
    """One NVIDIA GPU as NVML reports it; temperatures in °C, `throttle_reasons` the NVML bitmask."""

    index: int
    celsius: float | None
    slowdown_celsius: float | None
    shutdown_celsius: float | None
    throttle_reasons: int


def worse_memory(a: Level, b: Level) -> Level:
    """The more severe of two memory levels; "unavailable" loses to any reading."""
    order = {"unavailable": -1, **{lvl: i for i, lvl in enumerate(MEMORY_LEVELS)}}
    return a if order[a] >= order[b] else b


def worse_thermal(a: ThermalLevel, b: ThermalLevel) -> ThermalLevel:
    """The more severe of two thermal levels; "unavailable" loses to any reading."""
    order = {"unavailable": -1, **{lvl: i for i, lvl in enumerate(THERMAL_LEVELS)}}
    return a if order[a] >= order[b] else b


# ---- memory -----------------------------------------------------------------


def read_memory(
    *,
    psi_path: str = "/proc/pressure/memory",
    sysctl: Callable[[str], int | None] | None = None,
    virtual_memory: Callable[[], Any] | None = None,
    warning_psi_avg10: float = DEFAULT_WARNING_PSI_AVG10,
    critical_psi_avg10: float = DEFAULT_CRITICAL_PSI_AVG10,
    warning_available_fraction: float = DEFAULT_WARNING_AVAILABLE_FRACTION,
    critical_available_fraction: float = DEFAULT_CRITICAL_AVAILABLE_FRACTION,
) -> MemoryReading:
    """The system's memory pressure now.

    macOS (or whenever `sysctl` is given): the kernel's pressure level decides;
    psutil only fills in the sizes, since its "available" undercounts what the
    compressor can reclaim. Linux: PSI when `psi_path` is readable, combined
    with psutil's available fraction, the worse level wins. Elsewhere psutil
    alone. `virtual_memory` stands in for ``psutil.virtual_memory``.
    """
    vm = _virtual_memory(virtual_memory or psutil.virtual_memory)
    total, available = vm if vm else (0, 0)
    if sysctl is None and sys.platform == "darwin":
        sysctl = sysctl_int
    if sysctl is not None:
        raw = sysctl(MACOS_PRESSURE_SYSCTL)
        level = MACOS_PRESSURE_LEVELS.get(raw) if raw is not None else None
        if level is not None:
            return MemoryReading(level, total, available, f"macos:{MACOS_PRESSURE_SYSCTL}",
                                 {"pressure_level": raw})
    fraction_level: Level = "unavailable"
    detail: dict[str, Any] = {}
    if vm:
        fraction = available / total if total else 0.0
        detail["available_fraction"] = round(fraction, 4)
        fraction_level = _fraction_level(fraction, warning_available_fraction, critical_available_fraction)
    psi = parse_psi(_read_text(psi_path))
    if psi is not None:
        detail["psi"] = psi
        psi_level = _psi_level(psi, warning_psi_avg10, critical_psi_avg10)
        return MemoryReading(worse_memory(psi_level, fraction_level), total, available,
                             "linux:psi+psutil" if vm else "linux:psi", detail)
    if vm:
        return MemoryReading(fraction_level, total, available, "psutil", detail)
    return MemoryReading("unavailable", 0, 0, "none", detail)


def parse_psi(text: str | None) -> dict[str, dict[str, float]] | None:
    """``{"some": {"avg10": ..., "avg60": ..., "avg300": ..., "total": ...}, "full": {...}}`` or None.

    Format of /proc/pressure/* (Documentation/accounting/psi.rst); avg* are
    percentages of wall time, total is microseconds.
    """
    if not text:
        return None
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, _, rest = line.strip().partition(" ")
        if kind not in ("some", "full"):
            continue
        try:
            out[kind] = {k: float(v) for k, v in (pair.split("=", 1) for pair in rest.split())}
        except ValueError:
            return None
    return out if "some" in out else None


def _psi_level(psi: Mapping[str, Mapping[str, float]], warning: float, critical: float) -> Level:
    if psi.get("full", {}).get("avg10", 0.0) >= critical:
        return "critical"
    if psi["some"].get("avg10", 0.0) >= warning:
        return "warning"
    return "normal"


def _fraction_level(fraction: float, warning: float, critical: float) -> Level:
    if fraction < critical:
        return "critical"
    if fraction < warning:
        return "warning"
    return "normal"


def _virtual_memory(read: Callable[[], Any]) -> tuple[int, int] | None:
    try:
        vm = read()
        return int(vm.total), int(vm.available)
    except Exception:  # psutil may lack this platform or be denied: the reading says unavailable
        return None


def sysctl_int(name: str) -> int | None:
    """An integer sysctl by name without root: ``sysctlbyname`` through ctypes, else ``sysctl -n``."""
    value = _sysctlbyname_int(name)
    if value is not None:
        return value
    return parse_int(_run(["sysctl", "-n", name]))


def _sysctlbyname_int(name: str) -> int | None:
    libc_path = ctypes.util.find_library("c")
    if libc_path is None:
        return None
    try:
        libc = ctypes.CDLL(libc_path, use_errno=True)
        fn = libc.sysctlbyname
    except (OSError, AttributeError):  # no libc, or a libc without sysctlbyname (glibc)
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                   ctypes.c_size_t]
    fn.restype = ctypes.c_int
    buf = ctypes.c_int64(0)
    size = ctypes.c_size_t(ctypes.sizeof(buf))
    if fn(name.encode(), ctypes.byref(buf), ctypes.byref(size), None, 0) != 0:
        return None
    if size.value == 4:  # the kernel wrote an int into the low bytes (little-endian hosts)
        return ctypes.c_int32(buf.value & 0xFFFFFFFF).value
    return buf.value if size.value == 8 else None


def parse_int(text: str | None) -> int | None:
    """The integer in `text` (surrounding whitespace allowed), or None."""
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


# ---- thermal ----------------------------------------------------------------


def read_thermal(
    *,
    thermal_root: str = "/sys/class/thermal",
    pmset: Callable[[], str | None] | None = None,
    notify_state: Callable[[], int | None] | None = None,
    sensors: Callable[[], Mapping[str, Iterable[Any]]] | None = None,
    nvml: Callable[[], list[GpuThermal] | None] | None = None,
) -> ThermalReading:
    """The worst thermal level over every source that can be read here.

    Defaults: on macOS `notify_state` and `pmset` read the OS; everywhere the
    sysfs zones under `thermal_root`, ``psutil.sensors_temperatures`` and, if
    pynvml imports, NVML. A callable returning None means "not readable".
    """
    on_mac = sys.platform == "darwin"
    if notify_state is None and on_mac:
        notify_state = macos_thermal_pressure
    if pmset is None and on_mac:
        pmset = pmset_therm
    if sensors is None:
        sensors = getattr(psutil, "sensors_temperatures", None)
    if nvml is None:
        nvml = nvml_gpus
    found: list[tuple[str, ThermalLevel, float | None, Any]] = []
    if notify_state is not None:
        raw = notify_state()
        level = MACOS_THERMAL_PRESSURE.get(raw) if raw is not None else None
        if level is not None:
            found.append(("macos:thermalpressurelevel", level, None, raw))
    if pmset is not None:
        parsed = parse_pmset_therm(pmset())
        if parsed is not None:
            found.append(("macos:pmset", parsed[0], None, parsed[1]))
    zones = read_thermal_zones(thermal_root)
    if zones:
        found.append(_worst_of("linux:thermal_zone", zones))
    temps = _sensor_levels(_call_sensors(sensors))
    if temps:
        found.append(_worst_of("psutil:sensors", temps))
    gpus = nvml()
    if gpus:
        found.append(_worst_of("nvml", [(f"gpu{g.index}", *gpu_level(g), _gpu_detail(g)) for g in gpus]))
    if not found:
        return ThermalReading("unavailable", "none", None, {})
    source, level, _, _ = max(found, key=lambda f: THERMAL_LEVELS.index(f[1]))  # first of the worst
    temps_c = [c for _, _, c, _ in found if c is not None]
    detail = {name: {"level": lvl, "celsius": c, "raw": raw} for name, lvl, c, raw in found}
    return ThermalReading(level, source, max(temps_c) if temps_c else None, detail)


def _worst_of(
    source: str, items: list[tuple[str, ThermalLevel, float | None, Any]]
) -> tuple[str, ThermalLevel, float | None, Any]:
    level: ThermalLevel = "unavailable"
    for _, lvl, _, _ in items:
        level = worse_thermal(level, lvl)
    temps = [c for _, _, c, _ in items if c is not None]
    raw = {name: {"level": lvl, "celsius": c, **({"detail": d} if d else {})} for name, lvl, c, d in items}
    return source, level, max(temps) if temps else None, raw


def parse_pmset_therm(text: str | None) -> tuple[ThermalLevel, dict] | None:
    """Level and figures from ``pmset -g therm`` output, or None when it says nothing we know.

    CPU speed or scheduler limit below 100 % means the OS is throttling
    (serious; below 50 % critical); a recorded thermal warning level maps
    through `PMSET_WARNING_LEVELS`; "No thermal warning level has been
    recorded" with no limits below 100 is nominal.
    """
    if not text:
        return None
    figures: dict[str, int] = {}
    for key in ("CPU_Scheduler_Limit", "CPU_Available_CPUs", "CPU_Speed_Limit"):
        m = re.search(rf"{key}\s*=\s*(\d+)", text)
        if m:
            figures[key] = int(m.group(1))
    warning = re.search(r"thermal warning level\s*(?:=|:|set to)\s*(\d+)", text, re.IGNORECASE)
    no_warning = re.search(r"no thermal warning level", text, re.IGNORECASE)
    if not figures and warning is None and no_warning is None:
        return None
    level: ThermalLevel = "nominal"
    if warning is not None:
        figures["thermal_warning_level"] = int(warning.group(1))
        level = PMSET_WARNING_LEVELS.get(int(warning.group(1)), "nominal")
    limit = min((figures[k] for k in ("CPU_Speed_Limit", "CPU_Scheduler_Limit") if k in figures), default=100)
    if limit < PMSET_CRITICAL_LIMIT_PCT:
        level = worse_thermal(level, "critical")
    elif limit < 100:
        level = worse_thermal(level, "serious")
    return level, figures


def pmset_therm() -> str | None:
    """Output of ``pmset -g therm`` (macOS, no root needed), or None."""
    return _run(["pmset", "-g", "therm"])


def macos_thermal_pressure(libsystem: str = "/usr/lib/libSystem.B.dylib") -> int | None:
    """The notify(3) state of ``com.apple.system.thermalpressurelevel`` (0..4), or None off macOS."""
    try:
        lib = ctypes.CDLL(libsystem)
        register, get_state, cancel = lib.notify_register_check, lib.notify_get_state, lib.notify_cancel
    except (OSError, AttributeError):
        return None
    register.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    register.restype = ctypes.c_uint32
    get_state.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    get_state.restype = ctypes.c_uint32
    cancel.argtypes = [ctypes.c_int]
    cancel.restype = ctypes.c_uint32
    token = ctypes.c_int(-1)
    if register(MACOS_THERMAL_NOTIFY_NAME.encode(), ctypes.byref(token)) != 0:
        return None
    try:
        state = ctypes.c_uint64(0)
        if get_state(token, ctypes.byref(state)) != 0:
            return None
        return int(state.value)
    finally:
        cancel(token)


def read_thermal_zones(root: str) -> list[tuple[str, ThermalLevel, float | None, Any]]:
    """Each readable ``thermal_zone*`` under `root`: (name, level, °C, trips).

    Level from the zone's trip points: at or above a critical or hot trip is
    critical, a passive trip (the kernel starts throttling) serious, an
    active trip (fans) fair; a zone without trips is nominal.
    """
    out = []
    for zone in sorted(glob.glob(os.path.join(root, "thermal_zone*"))):
        millic = parse_int(_read_text(os.path.join(zone, "temp")))
        if millic is None:
            continue  # sensor asleep or erroring (EIO/ENODATA): skip, others may still read
        celsius = millic / 1000.0
        trips = _zone_trips(zone)
        level: ThermalLevel = "nominal"
        for kind, trip_c in trips:
            if celsius >= trip_c:
                level = worse_thermal(level, _TRIP_LEVELS.get(kind, "nominal"))
        name = (_read_text(os.path.join(zone, "type")) or "").strip() or os.path.basename(zone)
        out.append((f"{os.path.basename(zone)}:{name}", level, celsius, {"trips": trips}))
    return out


_TRIP_LEVELS: dict[str, ThermalLevel] = {"critical": "critical", "hot": "critical",
                                         "passive": "serious", "active": "fair"}


def _zone_trips(zone: str) -> list[tuple[str, float]]:
    trips = []
    for path in sorted(glob.glob(os.path.join(zone, "trip_point_*_temp"))):
        millic = parse_int(_read_text(path))
        kind = (_read_text(path[: -len("temp")] + "type") or "").strip()
        if millic is not None and millic > 0 and kind:  # 0 or negative marks a disabled trip
            trips.append((kind, millic / 1000.0))
    return trips


def _call_sensors(sensors: Callable[[], Mapping[str, Iterable[Any]]] | None) -> Mapping[str, Iterable[Any]]:
    if sensors is None:
        return {}
    try:
        return sensors() or {}
    except Exception:  # psutil raises on odd hwmon trees; a missing source is not an error
        return {}


def _sensor_levels(temps: Mapping[str, Iterable[Any]]) -> list[tuple[str, ThermalLevel, float | None, Any]]:
    """psutil ``shwtemp(label, current, high, critical)``: ≥ critical is critical, ≥ high serious."""
    out = []
    for chip, entries in temps.items():
        for i, entry in enumerate(entries):
            current = getattr(entry, "current", None)
            if current is None:
                continue
            high, crit = _positive(getattr(entry, "high", None)), _positive(getattr(entry, "critical", None))
            level: ThermalLevel = "nominal"
            if crit is not None and current >= crit:
                level = "critical"
            elif high is not None and current >= high:
                level = "serious"
            label = getattr(entry, "label", "") or str(i)
            out.append((f"{chip}:{label}", level, float(current), {"high": high, "critical": crit}))
    return out


def _positive(value: float | None) -> float | None:
    return float(value) if value is not None and value > 0 else None


def gpu_level(gpu: GpuThermal) -> tuple[ThermalLevel, float | None]:
    """A GPU's level: hardware thermal slowdown or ≥ shutdown °C is critical; software
    thermal or generic hardware slowdown, or ≥ slowdown °C, serious; within
    `DEFAULT_GPU_FAIR_MARGIN_C` of slowdown fair."""
    reasons, c = gpu.throttle_reasons, gpu.celsius
    if reasons & NVML_HW_THERMAL_SLOWDOWN or (
        c is not None and gpu.shutdown_celsius and c >= gpu.shutdown_celsius
    ):
        return "critical", c
    if reasons & (NVML_SW_THERMAL_SLOWDOWN | NVML_HW_SLOWDOWN) or (
        c is not None and gpu.slowdown_celsius and c >= gpu.slowdown_celsius
    ):
        return "serious", c
    if c is not None and gpu.slowdown_celsius and c >= gpu.slowdown_celsius - DEFAULT_GPU_FAIR_MARGIN_C:
        return "fair", c
    return "nominal", c


def _gpu_detail(gpu: GpuThermal) -> dict:
    return {"slowdown_celsius": gpu.slowdown_celsius, "shutdown_celsius": gpu.shutdown_celsius,
            "throttle_reasons": hex(gpu.throttle_reasons)}


def nvml_gpus(module: Any = None) -> list[GpuThermal] | None:
    """Every NVIDIA GPU's temperature, thresholds and clock-slowdown reasons, or None.

    `module` is ``pynvml`` (package nvidia-ml-py), imported here when not
    given; None when it is not installed or NVML cannot initialise (no driver).
    """
    if module is None:
        try:
            import pynvml as module  # type: ignore[no-redef]  # optional: never a hard dependency
        except ImportError:
            return None
    try:
        module.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: no NVIDIA GPU here
        return None
    try:
        return [_nvml_gpu(module, i) for i in range(module.nvmlDeviceGetCount())]
    except Exception:
        return None
    finally:
        try:
            module.nvmlShutdown()
        except Exception:
            pass


def _nvml_gpu(nv: Any, index: int) -> GpuThermal:
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    celsius = _nvml_optional(nv.nvmlDeviceGetTemperature, handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
    slowdown = _nvml_optional(nv.nvmlDeviceGetTemperatureThreshold, handle,
                              getattr(nv, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1))
    shutdown = _nvml_optional(nv.nvmlDeviceGetTemperatureThreshold, handle,
                              getattr(nv, "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", 0))
    # Renamed "clocks event reasons" in newer NVML; the old name remains as an alias in older bindings.
    reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    reasons = _nvml_optional(reasons_fn, handle) if reasons_fn else None
    return GpuThermal(
        index=index,
        celsius=float(celsius) if celsius is not None else None,
        # nvidia-smi prints these relative to T.Limit on newer drivers (negative numbers): never a threshold.
        slowdown_celsius=float(slowdown) if slowdown and slowdown > 0 else None,
        shutdown_celsius=float(shutdown) if shutdown and shutdown > 0 else None,
        throttle_reasons=int(reasons or 0),
    )


def _nvml_optional(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported on some boards: that figure is simply absent
        return None


# ---- processes --------------------------------------------------------------


def sample_processes(pids: Iterable[int]) -> dict[int, int]:
    """Resident set size in bytes of each pid still alive; gone or inaccessible pids are omitted."""
    out: dict[int, int] = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


# ---- helpers ----------------------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _run(argv: list[str], timeout_s: float = 5.0) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
