"""The offline bundle for a GPU machine without network: the project as a wheel, the distributions its image
lacks as wheels, and a script that installs them over the machine's own torch and runs `gpu_check`.

The carried distributions are packed from this environment's installation (the files its RECORD lists), so
the bundle needs no network either, and holds exactly the versions the project was tested with. Only pure
Python (or abi3) wheels are carried: the GPU machine's Python may be another version, and its compiled
packages (torch, pyarrow, ...) are its own.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from lowmem.errors import ConfigError

INSTALL_SCRIPT = "install_and_check.sh"
# Files of an installed distribution's metadata that describe that installation, not the wheel.
INSTALLATION_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}

SCRIPT_TEXT = """#!/usr/bin/env bash
# Install lowmem and what this machine's image lacks over its own torch (no network, no dependency
# resolution), then run the GPU check. Flags given to this script go to `lowmem gpu_check`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
"$python" -m pip install --no-index --no-deps --force-reinstall --quiet "$here"/*.whl
exec "$python" -m lowmem gpu_check "$@"
"""


@dataclass
class Bundle:
    """What was written: the folder and each wheel with its size."""

    folder: Path
    wheels: list[Path] = field(default_factory=list)

    def describe(self) -> str:
        """The bundle's contents and the command to run on the GPU machine."""
        total = sum(path.stat().st_size for path in self.wheels)
        lines = [f"{path.name}  {path.stat().st_size / 1e6:,.2f} MB" for path in self.wheels]
        return "\n".join([f"GPU bundle in {self.folder}: {len(self.wheels)} wheels, {total / 1e6:,.1f} MB", *lines,
                          f"On the GPU machine: bash {self.folder.name}/{INSTALL_SCRIPT} [gpu_check flags]"])


def project_root() -> Path:
    """The checkout this package runs from (the bundle builds the project's wheel from its source)."""
    import lowmem

    root = Path(lowmem.__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise ConfigError(f"lowmem runs from {root}, which is not a checkout of the project (no pyproject.toml): "
                          "build the bundle from a clone, where `pip install -e .` was run.")
    return root


def requirement_closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions `names` and every one they require (extras left out), each once."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    pending = list(names)
    while pending:
        name = pending.pop()
        key = _normalize(name)
        if key in found:
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ConfigError(f"{name} is not installed here: install it (pip install {name}) before building the "
                              "bundle, which packs the installed copy.") from None
        found[key] = distribution
        for text in distribution.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return list(found.values())


def pack_installed(distribution: metadata.Distribution, folder: Path) -> Path:
    """Write an installed pure-Python distribution back into a wheel, from the files its RECORD lists."""
    name, version = distribution.metadata["Name"], distribution.version
    tags = [line.split(":", 1)[1].strip() for line in (distribution.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    portable = tags and all(tag.endswith("-none-any") or "-abi3-" in tag for tag in tags)
    if not portable:
        raise ConfigError(f"{name} {version} is not a pure-Python wheel here (tags {tags or 'unknown'}): it cannot be "
                          "carried to another Python; it has to come with the GPU machine's own image.")
    files = [path for path in distribution.files or []
             if "__pycache__" not in path.parts and not str(path).startswith("..")]
    dist_info = next(path.parts[0] for path in files if path.parts[0].endswith(".dist-info"))
    wheel_path = folder / f"{_normalize(name).replace('-', '_')}-{version}-{tags[0]}.whl"
    record_lines = []
    with zipfile.ZipFile(wheel_path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for path in files:
            if path.parts[0] == dist_info and path.name in INSTALLATION_FILES:
                continue
            # typeshed types locate_file as its SimplePath protocol; installed distributions give a pathlib.Path.
            data = Path(distribution.locate_file(path)).read_bytes()  # type: ignore[arg-type]
            wheel.writestr(str(path), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record_lines.append(f"{path},sha256={digest},{len(data)}")
        record_lines.append(f"{dist_info}/RECORD,,")
        wheel.writestr(f"{dist_info}/RECORD", "\n".join(record_lines) + "\n")
    return wheel_path


def build_project_wheel(folder: Path) -> Path:
    """The project's own wheel, built from the checkout without network (no build isolation)."""
    root = project_root()
    with tempfile.TemporaryDirectory(prefix="lowmem-wheel-") as scratch:
        # From a copy: a build in place would leave build/ and *.egg-info in the checkout.
        source = Path(scratch) / "source"
        shutil.copytree(root, source, ignore=shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist",
                                                                    "*.egg-info", "__pycache__", "gpu_bundle",
                                                                    "gpu_check", "logs", "model_save", "tests"))
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                               "--no-index", "--quiet", "-w", str(folder), str(source)],
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"Building the project's wheel failed: {done.stderr.strip()[-1500:]}")
    return next(folder.glob("lowmem-*.whl"))


def build_bundle(folder: Path, packages: list[str]) -> Bundle:
    """Write the bundle into `folder` (made anew): the project's wheel, `packages` and what they require,
    and the install-and-check script."""
    if folder.exists():
        if any(path.suffix not in (".whl", ".sh") for path in folder.iterdir()):
            raise ConfigError(f"{folder} holds other files than a bundle's: choose another --out.")
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    bundle = Bundle(folder, [build_project_wheel(folder)])
    for distribution in requirement_closure(packages):
        bundle.wheels.append(pack_installed(distribution, folder))
    script = folder / INSTALL_SCRIPT
    script.write_text(SCRIPT_TEXT)
    script.chmod(0o755)
    return bundle


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
