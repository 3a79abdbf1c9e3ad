"""Probes of what this machine lets a test do."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def private_tmpfs_or_skip(folder, options: str) -> None:
    """Skip unless a tmpfs (mount -o `options`) can be mounted on `folder` in a private mount namespace (root and
    `unshare`): the tests that give a run a really read-only or full disk."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o {options} tmpfs {folder}"],
                           capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"no private tmpfs here: {probe.stderr.strip() if probe else 'no unshare'}")
