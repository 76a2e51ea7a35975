"""The memory limit of this process's own cgroup, cgroup v2 or v1.

Containers, SLURM jobs (`--mem=12G`) and systemd slices (`systemd-run -p MemoryMax=12G`) put a process in a
child cgroup whose limit the root files (`/sys/fs/cgroup/memory.max`) do not show. The process's own cgroup
is named in `/proc/self/cgroup`; where its hierarchy is mounted is in `/proc/self/mountinfo`. Every cgroup
from the process's up to the mount's root can carry a limit, and the tightest one applies (a parent slice
may be tighter than the child), so each level is read:

    v2   memory.max (the OOM killer acts above it) and memory.high (the kernel throttles the cgroup and
         reclaims hard above it: a run that lives there crawls), "max" meaning none
    v1   memory.limit_in_bytes, a value near 2**63 meaning none

The same walk finds the counters of OOM kills (`memory.events` in v2, `memory.oom_control` in v1), which
say afterwards whether the kernel's OOM killer ended a process of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# v1 writes "no limit" as a page-aligned value near 2**63; anything above 2**60 is no limit.
UNLIMITED_ABOVE = 2**60
# Where the hierarchies usually are, for a system whose mountinfo cannot be read.
_DEFAULT_V2_MOUNTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
_DEFAULT_V1_MEMORY_MOUNT = Path("/sys/fs/cgroup/memory")
V2_LIMIT_FILES = ("memory.max", "memory.high")
V1_LIMIT_FILES = ("memory.limit_in_bytes",)


@dataclass(frozen=True)
class CgroupLimit:
    """The tightest memory limit on the way up from this process's cgroup, and where it was read."""

    bytes: int
    path: Path  # the file that holds it, e.g. /sys/fs/cgroup/system.slice/job.scope/memory.max
    version: int  # 1 or 2

    def describe(self) -> str:
        """E.g. "cgroup v2 memory.high of /sys/fs/cgroup/user.slice/run-1.scope"."""
        return f"cgroup v{self.version} {self.path.name} of {self.path.parent}"


@dataclass(frozen=True)
class _Mount:
    point: Path  # where the hierarchy is mounted
    root: str  # the cgroup path the mount shows at its point ("/" unless the mount is of a sub-tree)


def parse_limit(text: str) -> int | None:
    """A limit file's value in bytes; None for "max", v1's near-2**63 "no limit", or text that is no number."""
    text = text.strip()
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED_ABOVE else value


def _own_cgroups(proc_cgroup_text: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) of the process from /proc/self/cgroup ("id:controllers:path" lines)."""
    v2, v1 = None, None
    for line in proc_cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _mounts(mountinfo_text: str) -> tuple[list[_Mount], list[_Mount]]:
    """(cgroup2 mounts, v1 mounts carrying the memory controller) from /proc/self/mountinfo.

    A line is "id parent major:minor root mount-point options [optional...] - fstype source super-options".
    """
    v2, v1 = [], []
    for line in mountinfo_text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 3:
            continue
        root, point = fields[3], Path(fields[4].replace("\\040", " "))
        fstype, super_options = fields[dash + 1], fields[dash + 3] if len(fields) > dash + 3 else ""
        if fstype == "cgroup2":
            v2.append(_Mount(point, root))
        elif fstype == "cgroup" and "memory" in super_options.split(","):
            v1.append(_Mount(point, root))
    return v2, v1


def _folder_of(cgroup_path: str, mount: _Mount) -> Path | None:
    """The folder of `cgroup_path` under `mount`, or None when the mount does not show that cgroup.

    Inside a container without its own cgroup namespace, /proc/self/cgroup names the host's path
    (/docker/<id>) while the container's mount shows only that sub-tree (root /docker/<id>): the part
    below the mount's root is what lies under its mount point.
    """
    root = mount.root.rstrip("/")
    if root and cgroup_path != root and not cgroup_path.startswith(root + "/"):
        return None
    relative = cgroup_path[len(root):].lstrip("/")
    folder = mount.point / relative if relative else mount.point
    return folder if folder.is_dir() else None


def _up_to(folder: Path, top: Path) -> list[Path]:
    """`folder` and each parent up to and including `top`."""
    chain = [folder]
    while folder != top and folder.parent != folder:
        folder = folder.parent
        chain.append(folder)
    return chain


@dataclass(frozen=True)
class OwnCgroup:
    """The folders of this process's memory cgroup and its ancestors, innermost first, and their version."""

    folders: tuple[Path, ...]
    version: int

    @property
    def limit_files(self) -> tuple[str, ...]:
        return V2_LIMIT_FILES if self.version == 2 else V1_LIMIT_FILES

    def tightest_limit(self) -> CgroupLimit | None:
        """The smallest limit set on the way up, or None when no level sets one."""
        best: CgroupLimit | None = None
        for folder in self.folders:
            for name in self.limit_files:
                try:
                    value = parse_limit((folder / name).read_text())
                except OSError:
                    continue
                if value is not None and (best is None or value < best.bytes):
                    best = CgroupLimit(value, folder / name, self.version)
        return best

    def oom_kills(self) -> int | None:
        """OOM kills counted in the innermost cgroup (its descendants included), or None where not counted."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (self.folders[0] / name).read_text()
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return None


def find_own_cgroup(proc_self: Path = Path("/proc/self")) -> OwnCgroup | None:
    """This process's memory cgroup (v2 first, else v1's memory controller), or None where there is none.

    Args:
        proc_self: the /proc folder of the process (a fake one in tests), holding `cgroup` and `mountinfo`.
    """
    try:
        v2_path, v1_path = _own_cgroups((proc_self / "cgroup").read_text())
    except OSError:
        return None
    try:
        v2_mounts, v1_mounts = _mounts((proc_self / "mountinfo").read_text())
    except OSError:
        v2_mounts = [_Mount(point, "/") for point in _DEFAULT_V2_MOUNTS]
        v1_mounts = [_Mount(_DEFAULT_V1_MEMORY_MOUNT, "/")]
    # A hybrid system has both; the memory controller is on one of them only: v1's when it is mounted.
    candidates = [(v1_path, mount, 1) for mount in v1_mounts] + [(v2_path, mount, 2) for mount in v2_mounts]
    for path, mount, version in candidates:
        if path is None:
            continue
        folder = _folder_of(path, mount)
        if folder is None or (version == 2 and not (mount.point / "cgroup.controllers").is_file()):
            continue
        if version == 2 and "memory" not in _v2_controllers(mount.point):
            continue
        return OwnCgroup(tuple(_up_to(folder, mount.point)), version)
    return None


def _v2_controllers(mount_point: Path) -> set[str]:
    try:
        return set((mount_point / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def own_cgroup_limit(proc_self: Path = Path("/proc/self")) -> CgroupLimit | None:
    """The tightest memory limit of this process's cgroup and its ancestors, or None when there is none."""
    cgroup = find_own_cgroup(proc_self)
    return None if cgroup is None else cgroup.tightest_limit()


def machine_oom_kills(vmstat: Path = Path("/proc/vmstat")) -> int | None:
    """Processes the kernel's OOM killer has ended on this machine since boot (`oom_kill` in /proc/vmstat)."""
    try:
        for line in vmstat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None
