"""ReplicaClient's `threads="auto"`: it measures its first push windows and starts the fetch
and push threads only where its compute hides its communication; and how Downpour resolves
`downpour.threads = "auto"` before the client sees it."""

from scaleout.ps.client import threads_pay
from scaleout.strategies.downpour import DownpourSection


def test_threads_pay_where_compute_hides_communication():
    assert threads_pay(compute_s=0.077, communication_s=0.016)
    assert not threads_pay(compute_s=0.002, communication_s=0.005)


def test_auto_is_off_for_grids_and_where_compute_takes_every_core():
    auto = DownpourSection(num_replicas=2, threads="auto")
    one_node = {"cpus": 8.0, "nodes": 1}
    assert auto.replica_threads(1, num_threads=1, **one_node) == "auto"  # 2 x (1 + 1) <= 8
    assert auto.replica_threads(1, num_threads=4, **one_node) is False  # 2 x (4 + 1) > 8
    assert auto.replica_threads(1, num_threads=None, **one_node) is False  # torch takes all 8
    assert auto.replica_threads(1, num_threads=None, cpus=16.0, nodes=2) == "auto"
    assert auto.replica_threads(2, num_threads=1, **one_node) is False  # a grid replica
    assert DownpourSection(threads=True).replica_threads(1, None, 2.0, 1) is True
    assert DownpourSection(threads=False).replica_threads(1, 1, 8.0, 1) is False
