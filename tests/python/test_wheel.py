"""Issue 27: ``pip install`` of kvtier's wheel gives the ``kvtier`` command.

Builds the wheel the way a release does (``scripts/build_wheel.sh``: ``maturin build --release``
with the release ``kvtier`` binary as wheel data), installs it into a fresh throwaway venv with
``--no-index`` and a ``PATH`` without cargo or rustc (so nothing can be compiled), and runs the
installed ``kvtier --help`` and ``kvtier config check`` and imports the module from outside the
repository. The wheel is abi3 (one wheel for CPython >= 3.11) and carries the licence.
"""

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800, **kw)


def test_the_wheel_installs_the_kvtier_command(tmp_path):
    env = dict(os.environ)
    maturin = Path(sys.executable).parent / "maturin"
    if maturin.exists():
        env["MATURIN"] = str(maturin)
    built = run(["bash", "scripts/build_wheel.sh", str(tmp_path / "dist")], cwd=ROOT, env=env)
    assert built.returncode == 0, built.stderr[-4000:]
    wheel = Path(built.stdout.strip().splitlines()[-1])
    assert wheel.exists(), built.stdout
    assert "-abi3-" in wheel.name, wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    scripts = [n for n in names if n.endswith(".data/scripts/kvtier")]
    assert scripts, names
    assert any(n.endswith(".abi3.so") for n in names), names
    assert any(n.endswith("LICENSE") for n in names), names
    assert not (ROOT / "kvtier.data").exists(), "the staging directory is removed"

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, symlinks=True)
    bin_dir = env_dir / "bin"
    # No Rust toolchain reachable: the install must not build anything.
    clean = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    installed = run(
        [
            str(bin_dir / "python"),
            "-m",
            "pip",
            "install",
            "--no-index",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            str(wheel),
        ],
        env=clean,
        cwd=tmp_path,
    )
    assert installed.returncode == 0, installed.stderr
    kvtier = bin_dir / "kvtier"
    assert kvtier.exists() and os.access(kvtier, os.X_OK)

    helped = run(["kvtier", "--help"], env=clean, cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    for sub in ("serve", "master", "stat", "fsck", "config"):
        assert sub in helped.stdout, helped.stdout

    config = tmp_path / "kvtier.toml"
    config.write_text('dram_capacity_bytes = "64MiB"\n')
    checked = run(["kvtier", "config", "check", str(config)], env=clean, cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("no_such_key = 1\n")
    refused = run(["kvtier", "config", "check", str(bad)], env=clean, cwd=tmp_path)
    assert refused.returncode == 1 and "no_such_key" in refused.stdout + refused.stderr

    imported = run(
        [str(bin_dir / "python"), "-c", "import kvtier, kvtier._native; print(kvtier.__file__)"],
        env=clean,
        cwd=tmp_path,
    )
    assert imported.returncode == 0, imported.stderr
    assert str(env_dir) in imported.stdout, imported.stdout
