"""studies.learning.runner.hosts: which hosts a (resumed) study's warm starts and runs came from."""

from __future__ import annotations

from studies.learning.runner import hosts


def _result(platform, cpu="EPYC", torch="2.13.0+cpu"):
    return {"seconds": 1.0, "machine": {"platform": platform, "cpu": cpu, "torch": torch, "load_average": [1.0]}}


def test_hosts_count_jobs_per_platform_cpu_and_torch():
    results = [_result("fc-v595"), _result("fc-v1045"), _result("fc-v595"), _result("fc-v595", torch="2.14.0")]
    assert hosts(results) == [
        {"platform": "fc-v595", "cpu": "EPYC", "torch": "2.13.0+cpu", "jobs": 2},
        {"platform": "fc-v1045", "cpu": "EPYC", "torch": "2.13.0+cpu", "jobs": 1},
        {"platform": "fc-v595", "cpu": "EPYC", "torch": "2.14.0", "jobs": 1},
    ]


def test_results_without_a_machine_are_one_unknown_host():
    # warm starts and runs written before the machine was recorded: load average alone never splits a host
    assert hosts([{"seconds": 1.0}, {"seconds": 2.0, "machine": None}, _result("fc-v1045")]) == [
        {"platform": None, "cpu": None, "torch": None, "jobs": 2},
        {"platform": "fc-v1045", "cpu": "EPYC", "torch": "2.13.0+cpu", "jobs": 1},
    ]
