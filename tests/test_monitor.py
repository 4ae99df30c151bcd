"""OS readers: memory pressure, thermal state and process RSS, against fixtures and this host."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from mlxrt.orchestrator import monitor
from mlxrt.orchestrator.monitor import GpuThermal, read_memory, read_thermal, sample_processes

VM = namedtuple("VM", "total available")
SHWTEMP = namedtuple("shwtemp", "label current high critical")
GIB = 1 << 30

PSI_CALM = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
PSI_SOME = ("some avg10=23.51 avg60=8.20 avg300=2.01 total=912345\n"
            "full avg10=1.20 avg60=0.40 avg300=0.10 total=1234\n")
PSI_FULL = ("some avg10=71.00 avg60=40.00 avg300=12.00 total=9912345\n"
            "full avg10=35.00 avg60=20.0 avg300=5.0 total=412345\n")

PMSET_NOMINAL = """Note: No thermal warning level has been recorded
Note: No performance warning level has been recorded
2024-03-01 10:00:00 +0100 CPU Power notify
\tCPU_Scheduler_Limit \t= 100
\tCPU_Available_CPUs \t= 12
\tCPU_Speed_Limit \t= 100
"""
PMSET_NOTES_ONLY = "Note: No thermal warning level has been recorded\n"
PMSET_THROTTLED = """2024-03-01 10:00:00 +0100 CPU Power notify
\tCPU_Scheduler_Limit \t= 100
\tCPU_Available_CPUs \t= 8
\tCPU_Speed_Limit \t= 62
"""
PMSET_HEAVY = "CPU_Scheduler_Limit = 80\nCPU_Available_CPUs = 8\nCPU_Speed_Limit = 35\n"
PMSET_WARNING_RECORDED = "Thermal Warning Level = 10\nCPU_Scheduler_Limit = 100\nCPU_Speed_Limit = 100\n"

QUIET = {"pmset": lambda: None, "notify_state": lambda: None, "sensors": lambda: {}, "nvml": lambda: None}


def psi_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "memory"
    path.write_text(text)
    return str(path)


def vm(total: int, available: int):
    return lambda: VM(total, available)


# ---- memory -----------------------------------------------------------------


def test_parse_psi_reads_some_and_full():
    """The /proc/pressure/memory format parses into percentages per line kind."""
    psi = monitor.parse_psi(PSI_SOME)
    assert psi["some"]["avg10"] == 23.51 and psi["some"]["total"] == 912345
    assert psi["full"]["avg10"] == 1.2


@pytest.mark.parametrize("text", ["", "garbage", "some avg10=x\n", "full avg10=1.0\n"])
def test_parse_psi_rejects_what_it_does_not_know(text):
    """Empty, malformed or some-less PSI text yields None rather than a guessed level."""
    assert monitor.parse_psi(text) is None


@pytest.mark.parametrize(
    ("psi", "available", "level"),
    [
        (PSI_CALM, 8 * GIB, "normal"),
        (PSI_SOME, 8 * GIB, "warning"),
        (PSI_FULL, 8 * GIB, "critical"),
        (PSI_CALM, int(0.08 * 16 * GIB), "warning"),
        (PSI_CALM, int(0.02 * 16 * GIB), "critical"),
        (PSI_SOME, int(0.02 * 16 * GIB), "critical"),
    ],
    ids=["calm", "some-stall", "full-stall", "low-available", "very-low-available", "worse-wins"],
)
def test_linux_psi_and_available_fraction_take_the_worse(tmp_path, psi, available, level):
    """On Linux the PSI level and the available-memory level combine as the worse of the two."""
    r = read_memory(psi_path=psi_file(tmp_path, psi), virtual_memory=vm(16 * GIB, available))
    assert r.level == level
    assert r.source == "linux:psi+psutil"
    assert (r.total_bytes, r.available_bytes) == (16 * GIB, available)
    assert "psi" in r.detail and "available_fraction" in r.detail


def test_psi_thresholds_are_settable(tmp_path):
    """Callers can tighten or loosen the PSI thresholds."""
    path = psi_file(tmp_path, PSI_SOME)
    ok = vm(16 * GIB, 8 * GIB)
    assert read_memory(psi_path=path, virtual_memory=ok, warning_psi_avg10=50.0).level == "normal"
    assert read_memory(psi_path=path, virtual_memory=ok, critical_psi_avg10=1.0).level == "critical"


def test_host_without_psi_uses_psutil_only(tmp_path):
    """Without /proc/pressure/memory (old kernels, containers, BSD) the level comes from psutil alone."""
    r = read_memory(psi_path=str(tmp_path / "absent"), virtual_memory=vm(16 * GIB, int(0.07 * 16 * GIB)))
    assert (r.level, r.source) == ("warning", "psutil")


@pytest.mark.parametrize(("raw", "level"), [(1, "normal"), (2, "warning"), (4, "critical")])
def test_macos_pressure_level_decides(tmp_path, raw, level):
    """On macOS the kernel's pressure level decides, even when psutil's available looks low."""
    seen = []

    def sysctl(name):
        seen.append(name)
        return raw

    r = read_memory(psi_path=str(tmp_path / "absent"), sysctl=sysctl, virtual_memory=vm(16 * GIB, 1))
    assert seen == ["kern.memorystatus_vm_pressure_level"]
    assert (r.level, r.source) == (level, "macos:kern.memorystatus_vm_pressure_level")
    assert r.detail["pressure_level"] == raw


@pytest.mark.parametrize("raw", [None, 0, 3, 7])
def test_macos_unreadable_or_unknown_falls_back_to_psutil(tmp_path, raw):
    """An unreadable or unknown macOS pressure value falls back to psutil instead of guessing."""
    r = read_memory(psi_path=str(tmp_path / "absent"), sysctl=lambda _: raw,
                    virtual_memory=vm(16 * GIB, 8 * GIB))
    assert (r.level, r.source) == ("normal", "psutil")


def test_memory_unavailable_when_nothing_reads(tmp_path):
    """With no PSI, no sysctl and psutil failing, the reading says unavailable."""

    def broken():
        raise OSError("no /proc/meminfo")

    r = read_memory(psi_path=str(tmp_path / "absent"), virtual_memory=broken)
    assert (r.level, r.source, r.total_bytes) == ("unavailable", "none", 0)


def test_memory_on_this_host():
    """The real readers on this machine give a real level and sizes."""
    r = read_memory()
    assert r.level in ("normal", "warning", "critical")
    assert 0 < r.available_bytes <= r.total_bytes
    expected = "linux:psi+psutil" if os.path.exists("/proc/pressure/memory") else "psutil"
    if sys.platform == "darwin":
        expected = "macos:kern.memorystatus_vm_pressure_level"
    assert r.source == expected


def test_parse_int_and_sysctl_off_macos():
    """Integer parsing tolerates whitespace; the macOS-only sysctl reads None elsewhere."""
    assert monitor.parse_int(" 4\n") == 4
    assert monitor.parse_int("four") is None and monitor.parse_int(None) is None
    if sys.platform != "darwin":
        assert monitor.sysctl_int(monitor.MACOS_PRESSURE_SYSCTL) is None


# ---- thermal: macOS -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "level"),
    [
        (PMSET_NOMINAL, "nominal"),
        (PMSET_NOTES_ONLY, "nominal"),
        (PMSET_THROTTLED, "serious"),
        (PMSET_HEAVY, "critical"),
        (PMSET_WARNING_RECORDED, "critical"),
    ],
    ids=["nominal", "notes-only", "speed-limit-62", "speed-limit-35", "warning-level-10"],
)
def test_pmset_therm_levels(text, level):
    """`pmset -g therm` output maps CPU limits and recorded warning levels onto thermal levels."""
    parsed = monitor.parse_pmset_therm(text)
    assert parsed is not None and parsed[0] == level


def test_pmset_figures_are_kept():
    """The parsed pmset figures are reported for the record."""
    _, figures = monitor.parse_pmset_therm(PMSET_THROTTLED)
    assert figures == {"CPU_Scheduler_Limit": 100, "CPU_Available_CPUs": 8, "CPU_Speed_Limit": 62}


@pytest.mark.parametrize("text", [None, "", "pmset: unknown option\n"])
def test_pmset_unknown_output_is_not_nominal(text):
    """Output pmset does not recognise is no reading, never a silent "nominal"."""
    assert monitor.parse_pmset_therm(text) is None


@pytest.mark.parametrize(
    ("state", "level"),
    [(0, "nominal"), (1, "fair"), (2, "serious"), (3, "critical"), (4, "critical")],
    ids=["nominal", "moderate", "heavy", "trapping", "sleeping"],
)
def test_macos_thermal_pressure_levels(tmp_path, state, level):
    """The notify thermal pressure state 0..4 maps to nominal, fair, serious, critical, critical."""
    r = read_thermal(thermal_root=str(tmp_path), **{**QUIET, "notify_state": lambda: state})
    assert (r.level, r.source) == (level, "macos:thermalpressurelevel")


def test_macos_worst_of_notify_and_pmset(tmp_path):
    """A throttling pmset outranks a moderate notify state; both are in the detail."""
    r = read_thermal(thermal_root=str(tmp_path), **{**QUIET, "notify_state": lambda: 1,
                                                    "pmset": lambda: PMSET_THROTTLED})
    assert (r.level, r.source) == ("serious", "macos:pmset")
    assert set(r.detail) == {"macos:thermalpressurelevel", "macos:pmset"}


def test_macos_readers_off_macos_read_nothing():
    """The libSystem notify reader returns None where libSystem does not exist."""
    if sys.platform == "darwin":
        assert monitor.macos_thermal_pressure() in (0, 1, 2, 3, 4)
    else:
        assert monitor.macos_thermal_pressure() is None


# ---- thermal: Linux sysfs -------------------------------------------------------


def make_zone(root: Path, n: int, *, kind: str, millic: int | None, trips: list[tuple[str, int]]) -> None:
    """A fake /sys/class/thermal/thermal_zoneN with a temperature and trip points."""
    zone = root / f"thermal_zone{n}"
    zone.mkdir(parents=True)
    (zone / "type").write_text(kind + "\n")
    if millic is not None:
        (zone / "temp").write_text(f"{millic}\n")
    for i, (trip_kind, trip_millic) in enumerate(trips):
        (zone / f"trip_point_{i}_type").write_text(trip_kind + "\n")
        (zone / f"trip_point_{i}_temp").write_text(f"{trip_millic}\n")


TRIPS = [("active", 60000), ("passive", 85000), ("hot", 95000), ("critical", 105000)]


@pytest.mark.parametrize(
    ("millic", "level"),
    [(45000, "nominal"), (65000, "fair"), (88000, "serious"), (96000, "critical"), (110000, "critical")],
    ids=["cool", "active", "passive", "hot", "critical"],
)
def test_thermal_zone_trip_points(tmp_path, millic, level):
    """A zone at or above a trip takes its level: active fair, passive serious, hot/critical critical."""
    make_zone(tmp_path, 0, kind="x86_pkg_temp", millic=millic, trips=TRIPS)
    r = read_thermal(thermal_root=str(tmp_path), **QUIET)
    assert (r.level, r.source) == (level, "linux:thermal_zone")
    assert r.celsius == millic / 1000


def test_thermal_zones_worst_wins_and_bad_zones_are_skipped(tmp_path):
    """The hottest-level zone decides; unreadable zones and disabled (0) trips are ignored."""
    make_zone(tmp_path, 0, kind="acpitz", millic=50000, trips=[("critical", 0), ("passive", 45000)])
    make_zone(tmp_path, 1, kind="x86_pkg_temp", millic=70000, trips=[("critical", 100000)])
    make_zone(tmp_path, 2, kind="iwlwifi", millic=None, trips=[("critical", 1000)])
    r = read_thermal(thermal_root=str(tmp_path), **QUIET)
    assert r.level == "serious"
    assert r.celsius == 70.0
    zones = r.detail["linux:thermal_zone"]["raw"]
    assert set(zones) == {"thermal_zone0:acpitz", "thermal_zone1:x86_pkg_temp"}
    assert zones["thermal_zone0:acpitz"]["detail"]["trips"] == [("passive", 45.0)]


def test_zone_without_trips_is_nominal(tmp_path):
    """A zone that reports a temperature but no trip points reads nominal, with its temperature."""
    make_zone(tmp_path, 0, kind="soc", millic=99000, trips=[])
    r = read_thermal(thermal_root=str(tmp_path), **QUIET)
    assert (r.level, r.celsius) == ("nominal", 99.0)


def test_psutil_sensors_high_and_critical(tmp_path):
    """psutil sensors at/above `high` read serious, at/above `critical` critical; None limits ignored."""
    temps = {
        "coretemp": [SHWTEMP("Package id 0", 82.0, 80.0, 100.0), SHWTEMP("Core 0", 60.0, None, None)],
        "nvme": [SHWTEMP("Composite", 40.0, 84.8, 84.8)],
    }
    r = read_thermal(thermal_root=str(tmp_path), **{**QUIET, "sensors": lambda: temps})
    assert (r.level, r.source, r.celsius) == ("serious", "psutil:sensors", 82.0)
    temps["nvme"][0] = SHWTEMP("Composite", 90.0, 84.8, 84.8)
    assert read_thermal(thermal_root=str(tmp_path), **{**QUIET, "sensors": lambda: temps}).level == "critical"


def test_psutil_sensors_raising_is_no_reading(tmp_path):
    """A sensors call that raises counts as no source rather than an error."""

    def broken():
        raise RuntimeError("odd hwmon tree")

    assert read_thermal(thermal_root=str(tmp_path), **{**QUIET, "sensors": broken}).level == "unavailable"


# ---- thermal: NVML ------------------------------------------------------------


class FakeNvml:
    """The subset of pynvml that `nvml_gpus` calls, with per-GPU canned answers."""

    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1

    class NVMLError(Exception):
        pass

    def __init__(self, gpus, *, init_fails=False):
        self.gpus = gpus
        self.init_fails = init_fails
        self.shut_down = False

    def nvmlInit(self):
        if self.init_fails:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return h["temp"]

    def nvmlDeviceGetTemperatureThreshold(self, h, kind):
        value = h["slowdown"] if kind == self.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN else h["shutdown"]
        if value is None:
            raise self.NVMLError("Not Supported")
        return value

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return h["reasons"]


def gpu(temp, reasons=0, slowdown=90, shutdown=95):
    return {"temp": temp, "reasons": reasons, "slowdown": slowdown, "shutdown": shutdown}


@pytest.mark.parametrize(
    ("spec", "level"),
    [
        (gpu(45), "nominal"),
        (gpu(45, reasons=0x1 | 0x4), "nominal"),  # idle + software power cap: not heat
        (gpu(83), "fair"),
        (gpu(91), "serious"),
        (gpu(60, reasons=0x20), "serious"),
        (gpu(60, reasons=0x8), "serious"),
        (gpu(60, reasons=0x40), "critical"),
        (gpu(96), "critical"),
        (gpu(60, slowdown=None, shutdown=None), "nominal"),
        (gpu(60, slowdown=-2, shutdown=-8), "nominal"),  # T.Limit-relative margins are no thresholds
    ],
    ids=["cool", "power-cap", "near-slowdown", "over-slowdown", "sw-thermal", "hw-slowdown",
         "hw-thermal", "over-shutdown", "no-thresholds", "relative-thresholds"],
)
def test_nvml_gpu_levels(tmp_path, spec, level):
    """NVML temperature against the board's thresholds and thermal clock slowdowns give the GPU's level."""
    fake = FakeNvml([spec])
    r = read_thermal(thermal_root=str(tmp_path), **{**QUIET, "nvml": lambda: monitor.nvml_gpus(fake)})
    assert (r.level, r.source, r.celsius) == (level, "nvml", float(spec["temp"]))
    assert fake.shut_down


def test_nvml_worst_gpu_and_worst_source(tmp_path):
    """Across GPUs and sources the worst level is reported, naming the source that set it."""
    make_zone(tmp_path, 0, kind="x86_pkg_temp", millic=65000, trips=TRIPS)
    fake = FakeNvml([gpu(40), gpu(70, reasons=0x20)])
    r = read_thermal(thermal_root=str(tmp_path), **{**QUIET, "nvml": lambda: monitor.nvml_gpus(fake)})
    assert (r.level, r.source, r.celsius) == ("serious", "nvml", 70.0)
    assert r.detail["nvml"]["raw"]["gpu1"]["level"] == "serious"
    assert r.detail["linux:thermal_zone"]["level"] == "fair"


def test_nvml_without_driver_or_package():
    """No NVIDIA driver (init fails) or no pynvml package means no NVML reading, not an error."""
    assert monitor.nvml_gpus(FakeNvml([gpu(40)], init_fails=True)) is None
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert monitor.nvml_gpus() is None


def test_gpu_objects_pass_straight_through(tmp_path):
    """Callers holding their own GPU readings can pass them without NVML."""
    g = GpuThermal(index=0, celsius=50.0, slowdown_celsius=None, shutdown_celsius=None, throttle_reasons=0x40)
    r = read_thermal(thermal_root=str(tmp_path), **{**QUIET, "nvml": lambda: [g]})
    assert r.level == "critical"


# ---- thermal: nothing -----------------------------------------------------------


def test_thermal_unavailable_with_no_sources(tmp_path):
    """With no zones, sensors, GPUs or macOS readers, the reading says unavailable."""
    r = read_thermal(thermal_root=str(tmp_path / "absent"), **QUIET)
    assert (r.level, r.source, r.celsius, r.detail) == ("unavailable", "none", None, {})


def _host_has_thermal_source() -> bool:
    """Whether this machine has a temperature that can be read: macOS, an NVIDIA GPU that NVML sees, a
    psutil sensor with a current value, or a sysfs zone whose temp reads as an integer."""
    import psutil

    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            nvml = pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # not installed, or no driver: no GPU source
        nvml = False
    try:
        sensors = getattr(psutil, "sensors_temperatures", lambda: {})() or {}
    except Exception:  # psutil raises on odd hwmon trees
        sensors = {}
    readable = any(getattr(e, "current", None) is not None for entries in sensors.values() for e in entries)
    zones = [z for z in glob.glob("/sys/class/thermal/thermal_zone*/temp") if _reads_an_int(z)]
    return sys.platform == "darwin" or nvml or readable or bool(zones)


def _reads_an_int(path: str) -> bool:
    try:
        with open(path) as f:
            int(f.read().strip())
    except (OSError, ValueError):
        return False
    return True


def test_thermal_on_this_host():
    """The real readers on this machine: a level from a named source where it has a thermal source,
    unavailable exactly when it has none."""
    r = read_thermal()
    if _host_has_thermal_source():
        assert r.level in ("nominal", "fair", "serious", "critical") and r.source != "none" and r.detail
    else:
        assert (r.level, r.source) == ("unavailable", "none")


# ---- processes ------------------------------------------------------------------


def test_sample_processes_omits_gone_pids():
    """RSS is reported for live pids and omitted for exited ones."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    rss = sample_processes([os.getpid(), child.pid])
    assert set(rss) == {os.getpid()}
    assert rss[os.getpid()] > 1 << 20
