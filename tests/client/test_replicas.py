"""Several replicas behind one client: round_robin spreads the streams, and a replica that goes away is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checkpoints import assert_bytes_identical, write_model
from tests.support.servers import running
from weightstream.client import WeightStreamClient
from weightstream.client.replicas import channel_target


def test_targets_become_one_grpc_target() -> None:
    assert channel_target("10.0.0.1:50051") == "10.0.0.1:50051"
    assert channel_target("dns:///ws-headless.ns.svc:50051") == "dns:///ws-headless.ns.svc:50051"
    assert channel_target(["10.0.0.1:1", "10.0.0.2:2"]) == "ipv4:10.0.0.1:1,10.0.0.2:2"
    assert channel_target("10.0.0.1:1, 10.0.0.2:2") == "ipv4:10.0.0.1:1,10.0.0.2:2"
    assert channel_target(["[::1]:1", "[::1]:2"]) == "ipv6:[::1]:1,[::1]:2"
    with pytest.raises(ValueError, match="dns:///"):
        channel_target(["ws-a:50051", "ws-b:50051"])
    with pytest.raises(ValueError, match="no server address"):
        channel_target([])


def test_loads_spread_over_replicas_and_survive_one_stopping(tmp_path: Path) -> None:
    state = write_model(tmp_path, "m", tensors=4, numel=256 * 1024)
    with running(tmp_path) as first, running(tmp_path) as second:
        with WeightStreamClient([first.target, second.target], progress=False) as client:
            for _ in range(8):
                assert_bytes_identical(state, client.load_state_dict("m"))
            streams = [r.server.stats.snapshot().streams_total for r in (first, second)]
            assert all(count >= 2 for count in streams), streams
            assert sum(streams) == 8

            first.server.stop(grace=0)
            for _ in range(4):
                assert_bytes_identical(state, client.load_state_dict("m"))
            assert second.server.stats.snapshot().streams_total == streams[1] + 4


def test_dns_name_of_one_replica(tmp_path: Path) -> None:
    state = write_model(tmp_path, "m", tensors=2, numel=1024)
    with running(tmp_path) as r, WeightStreamClient(f"dns:///{r.target}", progress=False) as client:
        assert_bytes_identical(state, client.load_state_dict("m"))
