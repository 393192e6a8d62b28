"""quantpipe.machine: what metrics/machine.json records, and how two records are compared."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import git
from helpers import ROOT
from quantpipe import machine
from quantpipe.errors import UserError


def _cpuinfo(cpus: list[tuple[int, int, int]], model: str = "Test CPU @ 2.0GHz",
             flags: str = "fpu avx2 avx512f avx512bw avx512_vnni") -> str:
    """/proc/cpuinfo text for (processor, physical id, core id) triples."""
    return "\n\n".join(f"processor\t: {p}\nmodel name\t: {model}\nphysical id\t: {s}\n"
                       f"core id\t\t: {c}\nflags\t\t: {flags}" for p, s, c in cpus) + "\n"


def test_probe_records_model_flags_cores_and_versions():
    info = machine.probe(_cpuinfo([(0, 0, 0), (1, 0, 1)]), affinity={0, 1}, cpu_quota=None)
    assert info["cpu"] == "Test CPU @ 2.0GHz"
    assert info["cpu_flags"] == {"avx2": True, "avx512f": True, "avx512bw": True,
                                 "avx512_vnni": True, "avx_vnni": False, "amx_tile": False,
                                 "amx_int8": False, "avx512_bf16": False, "amx_bf16": False,
                                 "avx512_fp16": False}
    assert info["cores"] == 2 and info["logical_cpus"] == 2
    import numpy
    import onnxruntime
    assert info["onnxruntime"] == onnxruntime.__version__
    assert info["numpy"] == numpy.__version__
    assert info["torch"].startswith("2.")


def test_probe_of_this_machine_is_stable_and_matches_proc_cpuinfo():
    first, second = machine.probe(), machine.probe()
    assert first == second  # same machine, same record: the DVC hash does not move
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert first["cpu_flags"] == {f: f in flags for f in machine.CPU_FLAGS}
    assert 1 <= first["cores"] <= first["logical_cpus"]


def test_hyperthreads_count_once_and_affinity_limits_the_cores():
    # 2 sockets x 2 cores x 2 hyper-threads: CPUs 0-3 on socket 0, 4-7 on socket 1.
    text = _cpuinfo([(0, 0, 0), (1, 0, 1), (2, 0, 0), (3, 0, 1),
                     (4, 1, 0), (5, 1, 1), (6, 1, 0), (7, 1, 1)])
    assert machine.probe(text, affinity=set(range(8)), cpu_quota=None)["cores"] == 4
    assert machine.probe(text, affinity={0, 2}, cpu_quota=None)["cores"] == 1  # siblings
    pinned = machine.probe(text, affinity={0, 1, 4}, cpu_quota=None)
    assert pinned["cores"] == 3 and pinned["logical_cpus"] == 3


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    text = _cpuinfo([(i, 0, i) for i in range(8)])
    assert machine.probe(text, affinity=set(range(8)), cpu_quota=2.0)["cores"] == 2
    assert machine.probe(text, affinity=set(range(8)), cpu_quota=1.5)["cores"] == 2  # rounded up
    assert machine.probe(text, affinity=set(range(8)), cpu_quota=0.2)["cores"] == 1
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert machine.cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert machine.cgroup_cpu_quota(tmp_path) is None
    assert machine.cgroup_cpu_quota(tmp_path / "absent") is None


def test_describe_names_cpu_cores_isa_and_versions():
    info = machine.probe(_cpuinfo([(0, 0, 0), (1, 0, 0)]), affinity={0, 1}, cpu_quota=None)
    text = machine.describe(info)
    assert text.startswith("Test CPU @ 2.0GHz, 1 core (2 logical CPUs); avx2, avx512f, avx512bw, "
                           "avx512_vnni (no avx_vnni, amx_tile, amx_int8, avx512_bf16, amx_bf16, "
                           "avx512_fp16); onnxruntime ")
    assert machine.describe({"cpu": "Old", "cpu_flags": {"avx2": False}}) == \
        "Old; no AVX2/AVX-512/VNNI/AMX (no avx2)"


def test_native_bf16_needs_avx512_bf16_or_amx_bf16():
    vnni = {"cpu_flags": {f: f in ("avx2", "avx512f", "avx512_vnni") for f in machine.CPU_FLAGS}}
    assert "no native BF16" in machine.bf16_missing(vnni)
    assert "no native BF16" in machine.bf16_missing({})  # a record from before the BF16 flags
    for flag in machine.NATIVE_BF16:  # an EPYC has avx512_bf16 alone; a Xeon both
        assert machine.bf16_missing({"cpu_flags": {**vnni["cpu_flags"], flag: True}}) is None


def test_differences_name_each_changed_field():
    base = machine.probe(_cpuinfo([(0, 0, 0), (1, 0, 1)]), affinity={0, 1}, cpu_quota=None)
    assert machine.differences(base, base) == []
    other = {**base, "cpu": "Other CPU", "cores": 4,
             "cpu_flags": {**base["cpu_flags"], "amx_int8": True}}
    assert machine.differences(base, other) == [
        "cpu: Test CPU @ 2.0GHz -> Other CPU", "amx_int8: no -> yes", "cores: 2 -> 4"]
    # A record from before metrics/machine.json (no cores, fewer flags) compares what both have.
    old = {"cpu": base["cpu"], "cpu_flags": {"avx2": True, "avx512_vnni": True},
           "onnxruntime": base["onnxruntime"]}
    assert machine.differences(old, base) == []
    assert machine.differences(base, {**base, "python": "3.12.0"}) == []  # recorded, not compared


def test_recorded_machine_falls_back_to_the_bench_json_of_older_revisions():
    record = {"cpu": "X", "cpu_flags": {"avx2": True}}
    assert machine.recorded_machine({"metrics/machine.json": json.dumps(record)}) == record
    older = {"metrics/machine.json": None,
             "metrics/bench/static.json": json.dumps({"variant": "static", "machine": record})}
    assert machine.recorded_machine(older) == record
    assert machine.recorded_machine({"metrics/machine.json": "{not json"}) is None
    assert machine.recorded_machine({}) is None


def test_compare_note_says_same_or_different_machines():
    a = machine.probe(_cpuinfo([(0, 0, 0)]), affinity={0}, cpu_quota=None)
    b = {**a, "cpu": "Other CPU"}
    assert machine.compare_note("main", a, a).startswith(
        "Machine: main and the workspace were measured on the same kind of machine: Test CPU")
    note = machine.compare_note("main", a, b)
    assert note.startswith("**Measured on different machines** (cpu: Test CPU @ 2.0GHz -> Other CPU).")
    assert "main: Test CPU" in note and "Workspace: Other CPU" in note
    assert "main records no machine" in machine.compare_note("main", None, a)


def test_load_refuses_a_record_without_cores(tmp_path):
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({"cpu": "X", "cores": 0}))
    with pytest.raises(UserError, match=r"machine\.json: 'cores' is 0, not a count; re-create it "
                                        r"with `dvc repro machine`"):
        machine.load(path)
    with pytest.raises(UserError, match="not found"):
        machine.load(tmp_path / "absent.json")
    path.write_text(json.dumps({"cpu": "X", "cores": 3}))
    assert machine.load(path)["cores"] == 3


def test_compare_cli_reads_the_base_revision_from_git(tmp_path):
    repo = tmp_path / "repo"
    (repo / "metrics").mkdir(parents=True)
    here = machine.probe()
    (repo / "metrics/machine.json").write_text(json.dumps({**here, "cpu": "Committed CPU"}))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "metrics from another machine")
    (repo / "metrics/machine.json").write_text(json.dumps(here))

    def compare(rev: str) -> str:
        return subprocess.run([sys.executable, "-m", "quantpipe.machine", "compare", rev], cwd=repo,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, check=True).stdout

    assert compare("main").startswith(f"**Measured on different machines** (cpu: Committed CPU -> {here['cpu']})")
    git(repo, "commit", "-qam", "re-measured here")
    assert compare("main").startswith("Machine: main and the workspace were measured on the same")
