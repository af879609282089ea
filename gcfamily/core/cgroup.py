"""The CPU quota a cgroup puts on this process, in cores: cgroup v2's cpu.max, or v1's cfs_quota_us / cfs_period_us.

A container given 1.5 CPUs on a 64-core machine sees 64 cores in its affinity; threads past the quota are throttled
every period, so the quota counts as ceil(quota) cores (core/threads.py). Every file is read defensively: a missing,
short or garbled file is no quota.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read(4096)
    except (OSError, UnicodeDecodeError):
        return None


def quota_of(quota: str, period: str) -> Optional[float]:
    """Cores a quota of `quota` microseconds every `period` gives; None when it is no limit ("max", -1) or garbled."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _lowest(quotas: list[Optional[float]]) -> Optional[float]:
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _ancestors(root: Path, group: str) -> list[Path]:
    """The cgroup folder of `group` under root and every folder above it up to root (a parent's quota binds too)."""
    parts = [p for p in group.strip().split("/") if p and p not in (".", "..")]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def cgroup_quota(root: Path = ROOT, self_cgroup: Optional[str] = None) -> Optional[float]:
    """The lowest CPU quota over this process's cgroup and its ancestors, in cores; None when there is none.

    `self_cgroup` is /proc/self/cgroup's text (read when None): `0::/path` for v2, `N:cpu,cpuacct:/path` for v1."""
    text = _read(Path("/proc/self/cgroup")) if self_cgroup is None else self_cgroup
    if not text:
        return None
    quotas: list[Optional[float]] = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, group = fields
        if controllers == "":  # v2: cpu.max is "QUOTA PERIOD" or "max PERIOD"
            for folder in _ancestors(root, group):
                words = (_read(folder / "cpu.max") or "").split()
                quotas.append(quota_of(words[0], words[1]) if len(words) == 2 else None)
        elif "cpu" in controllers.split(","):  # v1: mounted as cpu, cpu,cpuacct or cpuacct,cpu
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                for folder in _ancestors(mount, group):
                    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
                    quotas.append(quota_of(quota.strip(), period.strip()) if quota and period else None)
    return _lowest(quotas)
