"""What a user installs: the sdist and the wheel built from it hold every package, the .proto,
the generated stubs and ``py.typed``; the wheel, installed without ``-e`` into a fresh
virtual environment, imports every module and runs the console script from outside the
checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The design card's folders, installed as resihp.<name> (setup.py's package_dir).
NAMESPACE_FOLDERS = ("agent", "proto", "trainer_hooks", "coordinator", "sim")
SKIP = {".git", ".venv", "build", "dist", "runs", "resihp-runs", "__pycache__", ".pytest_cache", ".mypy_cache",
        ".ruff_cache", ".mypyroot"}


def source_packages() -> set[str]:
    """Every package of the source tree, by the name it has once installed."""
    found = {"resihp"}
    roots = [(REPO / "resihp", "resihp")] + [(REPO / name, f"resihp.{name}") for name in NAMESPACE_FOLDERS]
    for root, prefix in roots:
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            if rel.parts and rel.parts[0] in NAMESPACE_FOLDERS and root.name == "resihp":
                continue  # resihp/<folder> is a link to a top-level folder, counted there
            found.add(".".join((prefix, *rel.parts)) if rel.parts else prefix)
    return found


def source_modules() -> set[str]:
    """Every importable module and package of the source tree, by its installed name."""
    modules = source_packages() - {"resihp"}
    for package in source_packages():
        parts = package.split(".")
        folder = REPO / "resihp" if len(parts) == 1 else (REPO / "resihp" if parts[1] not in NAMESPACE_FOLDERS
                                                            else REPO).joinpath(*parts[1:])
        modules |= {f"{package}.{f.stem}" for f in folder.glob("*.py") if f.stem not in ("__init__", "__main__")}
    return modules


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An sdist built from a copy of the checkout, and the wheel built from that sdist (so a
    file the sdist forgets is missing from the wheel too, as for a user who builds from PyPI)."""
    if importlib_missing("build"):
        pytest.skip("the 'build' package is not installed (make venv installs it)")
    work = tmp_path_factory.mktemp("dist")
    src = work / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=lambda d, names: [n for n in names if n in SKIP
                                                                       or n.endswith(".egg-info")])
    out = work / "out"
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), str(src)], cwd=work)
    (sdist,) = out.glob("resihp-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(work / "unpacked", filter="data")
    (unpacked,) = (work / "unpacked").iterdir()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
          str(unpacked)], cwd=work)
    return out


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def test_sdist_and_wheel_hold_every_package_the_proto_and_the_typing_marker(dist_dir: Path) -> None:
    (wheel,) = dist_dir.glob("resihp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    in_wheel = {n[: -len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert in_wheel == source_packages()
    for needed in ("resihp/py.typed", "resihp/proto/resihp.proto", "resihp/proto/resihp_pb2.pyi",
                   "resihp/proto/resihp_pb2.py", "resihp/proto/resihp_pb2_grpc.py", "resihp/sim/policies/resihp.py"):
        assert needed in names, needed
    assert not any(n.startswith(("tests/", "bench/", "coordinator/", "proto/")) for n in names), "squats a name"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "resihp = resihp.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    (sdist,) = dist_dir.glob("resihp-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    for needed in ("resihp/py.typed", "proto/resihp.proto", "proto/resihp_pb2.pyi", "pyproject.toml", "setup.py"):
        assert needed in members, needed


@pytest.fixture(scope="module")
def fresh_venv(dist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment with the wheel installed the ordinary way (not editable). Its
    third-party dependencies come from this interpreter's site-packages through a path entry,
    so the test needs no network; pip still resolves the wheel's declared requirements
    against them (--no-index: a requirement nothing satisfies fails the install)."""
    venv = tmp_path_factory.mktemp("venv") / "fresh"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=venv.parent)
    py = venv / "bin" / "python"
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=venv.parent).strip()
    # A bare path line: the directory joins sys.path but its own .pth files (the editable
    # install's finder among them) are not run, so the checkout stays invisible.
    Path(site, "resihp_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (wheel,) = dist_dir.glob("resihp-*.whl")
    _run([str(py), "-m", "pip", "install", "-q", "--no-index", str(wheel)], cwd=venv.parent)
    return venv


def _outside(venv: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


WALK = """
import importlib, json, pkgutil, resihp
names = sorted(m.name for m in pkgutil.walk_packages(resihp.__path__, "resihp.") if not m.name.endswith("__main__"))
for name in names:
    importlib.import_module(name)
print(json.dumps({"file": resihp.__file__, "modules": names,
                  "packages": sorted(m.name for m in pkgutil.walk_packages(resihp.__path__, "resihp.") if m.ispkg)}))
"""


def test_the_installed_wheel_imports_every_module_from_outside_the_checkout(fresh_venv: Path, tmp_path: Path) -> None:
    out = _run([str(fresh_venv / "bin" / "python"), "-c", WALK], cwd=tmp_path, env=_outside(fresh_venv, tmp_path))
    found = json.loads(out.strip().splitlines()[-1])
    assert Path(found["file"]).resolve().is_relative_to(fresh_venv.resolve()), found["file"]
    assert set(found["packages"]) | {"resihp"} == source_packages()
    assert set(found["modules"]) == source_modules()
    for must in ("resihp.sim.policies.resihp", "resihp.coordinator.planner.search", "resihp.proto.resihp_pb2_grpc",
                 "resihp.trainer_hooks.reconfig.live", "resihp.report.cli"):
        assert must in found["modules"]


def test_the_installed_console_script_runs_simulate_plan_and_detect(fresh_venv: Path, tmp_path: Path) -> None:
    env = _outside(fresh_venv, tmp_path)
    exe = str(fresh_venv / "bin" / "resihp")
    assert "simulate" in _run([exe, "--help"], cwd=tmp_path, env=env)
    sim = _run([exe, "simulate", "--scenario", "paper-mixed", "--hours", "0.2"], cwd=tmp_path, env=env)
    assert "resihp vs best baseline" in sim and "ckpt-restart" in sim
    ex = REPO / "examples" / "plan"
    plan = json.loads(_run([exe, "plan", "--cluster", str(ex / "cluster-2x4-slow.json"),
                            "--model", str(ex / "model-llama2-7b.json"), "--current", str(ex / "current-tp2-pp2-dp2.json"),
                            "--finding", str(ex / "finding-slow-rank2.json"), "--json"], cwd=tmp_path, env=env))
    assert plan["plan"]["replicas"], plan
    findings = _run([exe, "detect", "--trace", str(REPO / "examples" / "traces" / "slow-then-stop.jsonl")],
                    cwd=tmp_path, env=env)
    rows = [json.loads(line) for line in findings.splitlines()]
    assert [(r["kind"], r["ranks"], r["cause"]) for r in rows] == [
        ("fail-slow", [6], "compute"), ("fail-stop", [1], "process-exit")]


def test_the_wheel_ships_the_examples_and_runs_one_from_outside_the_checkout(dist_dir: Path, fresh_venv: Path,
                                                                            tmp_path: Path) -> None:
    """`resihp demo`'s default script and the model examples come with the wheel (as data under
    <prefix>/share/resihp/examples), `resihp examples` finds them in the venv, not in this
    checkout, and the installed train_gpt.py trains a few steps against the installed package."""
    (wheel,) = dist_dir.glob("resihp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("train_gpt.py", "train_ddp.py", "nanogpt/train_resilient.py", "nanogpt/model.py",
                   "nanogpt/layout.py", "llama/train.py", "plan/cluster-2x4-slow.json", "traces/slow-then-stop.jsonl"):
        assert any(n.endswith(f".data/data/share/resihp/examples/{needed}") for n in names), needed
    env = _outside(fresh_venv, tmp_path)
    exe = str(fresh_venv / "bin" / "resihp")
    folder = Path(_run([exe, "examples"], cwd=tmp_path, env=env).strip())
    assert folder.resolve().is_relative_to(fresh_venv.resolve()) and (folder / "train_gpt.py").is_file(), folder
    assert str(folder / "train_gpt.py") in "".join(_run([exe, "demo", "--help"], cwd=tmp_path, env=env).split())
    copy = tmp_path / "mine"
    _run([exe, "examples", "--copy", str(copy)], cwd=tmp_path, env=env)
    assert (copy / "nanogpt" / "train_resilient.py").read_bytes() == (folder / "nanogpt" / "train_resilient.py").read_bytes()
    # the fresh venv borrows this interpreter's packages through a bare path entry, which skips
    # the setup that lets mpi4py find the Open MPI wheel's library (and its launcher binaries)
    (libmpi,) = [p for p in Path(sys.prefix, "lib").glob("libmpi.so.*") if p.stat().st_size > 4096][:1]
    env = {**env, "MPI4PY_LIBMPI": str(libmpi), "PATH": f"{env['PATH']}{os.pathsep}{Path(sys.prefix) / 'bin'}"}
    out = _run([str(fresh_venv / "bin" / "python"), str(folder / "train_gpt.py"), "--steps", "3", "--log-every", "1"],
               cwd=tmp_path, env=env)
    losses = [float(line.split("loss")[1].split()[0]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and all(0.0 < x < 10.0 for x in losses), out
