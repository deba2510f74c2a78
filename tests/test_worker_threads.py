"""Local workers share the machine's CPUs: each gets its share of threads, unless the user says."""

from router.launcher import worker_environment, worker_threads


def test_each_worker_gets_its_share_of_the_cpus():
    assert worker_threads(cpus=128, workers=16) == 8
    assert worker_threads(cpus=128, workers=9) == 14
    assert worker_threads(cpus=2, workers=3) == 1  # never zero
    assert worker_threads(cpus=4, workers=0) == 4


def test_the_users_setting_wins():
    assert worker_environment({"PATH": "/bin"}, {}, 8) == {"PATH": "/bin", "OMP_NUM_THREADS": "8"}
    assert worker_environment({"OMP_NUM_THREADS": "3"}, {}, 8)["OMP_NUM_THREADS"] == "3"
    assert worker_environment({}, {"OMP_NUM_THREADS": "2", "DYAD_JOIN_TOKEN": "t"}, 8) == {
        "OMP_NUM_THREADS": "2",
        "DYAD_JOIN_TOKEN": "t",
    }
