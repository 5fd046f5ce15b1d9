"""One rank, one device: a rank confined to a CPU quota in its own cgroup (launch/cpu_share.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from resihp.trainer_hooks.launch import cpu_share
from resihp.trainer_hooks.launch.launcher import cpu_per_rank, cpu_share_command


def _writable() -> bool:
    try:
        cpu_share.cpu_root()
        return True
    except cpu_share.CpuShareError:
        return False


@pytest.mark.skipif(not _writable(), reason="no writable CPU cgroup controller (needs root)")
def test_a_rank_runs_in_its_own_cgroup_with_its_quota_and_the_group_is_released() -> None:
    group = f"resihp-test-{os.getpid()}"
    probe = ("import pathlib; print([l for l in pathlib.Path('/proc/self/cgroup').read_text().splitlines() "
             "if ':cpu' in l or l.startswith('0::')])")
    done = subprocess.run([sys.executable, "-m", "resihp.trainer_hooks.launch.cpu_share", "--cores", "0.25", "--group",
                           group, "--", sys.executable, "-c", probe],
                          env={**os.environ, "OMPI_COMM_WORLD_RANK": "3"}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"/{group}/rank-3" in done.stdout  # the exec'd command itself is in the rank's group
    root, version = cpu_share.cpu_root()
    leaf = root / group / "rank-3"
    if version == 1:
        assert (leaf / "cpu.cfs_quota_us").read_text().strip() == str(cpu_share.PERIOD_US // 4)
        assert (leaf / "cpu.cfs_period_us").read_text().strip() == str(cpu_share.PERIOD_US)
    else:
        assert (leaf / "cpu.max").read_text().split() == [str(cpu_share.PERIOD_US // 4), str(cpu_share.PERIOD_US)]
    assert cpu_share.release(group) == 1 and not (root / group).exists()


def test_bad_requests_are_refused_before_anything_runs() -> None:
    with pytest.raises(cpu_share.CpuShareError, match="cores must be a number of CPUs > 0"):
        cpu_share.confine("g", "rank-0", 0.0)
    with pytest.raises(cpu_share.CpuShareError, match="plain names"):
        cpu_share.confine("../etc", "rank-0", 0.5)
    done = subprocess.run([sys.executable, "-m", "resihp.trainer_hooks.launch.cpu_share", "--cores", "0.5",
                           "--group", "g"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give the command after '--'" in done.stderr


def test_the_launchers_option_reads_auto_and_numbers() -> None:
    errors: list[str] = []
    assert cpu_per_rank("", 8, errors.append) == 0.0
    assert cpu_per_rank("auto", 8, errors.append) == pytest.approx((os.cpu_count() or 1) / 8)
    assert cpu_per_rank("0.5", 8, errors.append) == 0.5 and not errors
    cpu_per_rank("lots", 8, errors.append)
    cpu_per_rank("-1", 8, errors.append)
    assert len(errors) == 2 and "expected a number of CPUs > 0 or 'auto', got 'lots'" in errors[0]
    line = cpu_share_command(0.25, "resihp-j", ["python", "train.py"])
    assert line[1:3] == ["-m", "resihp.trainer_hooks.launch.cpu_share"] and line[-3:] == ["--", "python", "train.py"]
    assert line[line.index("--cores") + 1] == "0.2500" and line[line.index("--group") + 1] == "resihp-j"
