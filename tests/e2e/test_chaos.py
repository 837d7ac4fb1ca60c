"""Chaos: loads survive a server killed with SIGKILL and connections cut mid-stream, bit for bit.

The server is a real `weightstream serve` process under a supervisor that restarts it; the cuts
come from a real TCP proxy on loopback. Figures go to the reliability summary.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.harness import write_checkpoint
from tests.support.checkpoints import digests, file_digests, write_model
from tests.support.faults import CuttingProxy
from tests.support.reliability_report import record
from tests.support.serve_processes import Supervisor
from weightstream.client import FailedPreconditionError, RetryPolicy, WeightStreamClient
from weightstream.samples import ParameterTree
from weightstream_server import WeightStreamServer

# Supervised `weightstream serve` processes killed with SIGKILL, on a 1 GB checkpoint.
pytestmark = pytest.mark.slow

MODEL = "chaos-llama"
GB = 1.0
KILLS = 10
# Quicker than the defaults, so that ten restarts fit in the test's time; as many tries as it takes
# a restarting server (about 2 s here) to answer again.
POLICY = RetryPolicy(attempts=100, initial_backoff=0.05, max_backoff=0.5, total_deadline=60.0, idle_timeout=30.0)
POLL_S = 0.005
# What a user gets without asking: the restart tests below run with it.
DEFAULT_POLICY = RetryPolicy()
# A restart as slow as a real one: the supervisor starts the next server this long after a death,
# and that server then takes its own start-up (over a second here) before it listens.
RESTART_DELAY_S = 0.3
# Kills in a row of a server still starting, once in the restart test: a crash loop.
CRASH_LOOP = 5
# Every SAMPLE_STRIDE-th element of each parameter is read to tell how much of a load has landed.
SAMPLE_STRIDE = 1 << 15
# A server down for longer than ten tries of the default policy last when each fails at once
# against the channel's reconnect backoff (about 20 s here).
LONG_OUTAGE_S = 30.0


@pytest.fixture(scope="module")
def chaos_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chaos-models")
    write_checkpoint(root / MODEL, GB)
    return root


@pytest.fixture(scope="module")
def expected(chaos_root: Path) -> dict[str, str]:
    return file_digests(chaos_root / MODEL)


def _module(folder: Path) -> ParameterTree:
    shapes = {}
    for path in sorted(folder.glob("*.safetensors")):
        shapes.update({n: (tuple(t.shape), t.dtype) for n, t in load_file(str(path)).items()})
    return ParameterTree(shapes)


def _nbytes(module: torch.nn.Module, name: str) -> int:
    tensor = module.get_parameter(name)
    return tensor.numel() * tensor.element_size()


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in module.named_parameters()}


class _Killer:
    """Kills the supervised server once a given share of the module's tensors has landed.

    A tensor counts as landed when its last element is no longer zero (the module starts zeroed,
    and chunks of a tensor arrive in order), so the kill falls inside the load at a random depth
    whatever the machine's speed.
    """

    def __init__(self, supervisor: Supervisor, module: torch.nn.Module, share: float) -> None:
        self._supervisor = supervisor
        self._lasts = [p.detach().view(-1)[-1:] for p in module.parameters()]
        self._needed = max(1, int(share * len(self._lasts)))
        self._done = threading.Event()
        self.killed_at: int | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-killer", daemon=True)

    def __enter__(self) -> _Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._done.wait(POLL_S):
            landed = sum(1 for last in self._lasts if bool(last.ne(0).item()))
            if landed >= self._needed:
                self._supervisor.kill()
                self.killed_at = landed
                return


def test_sigkill_during_loads_then_every_tensor_is_identical(
    chaos_root: Path, expected: dict[str, str], tmp_path: Path
) -> None:
    module = _module(chaos_root / MODEL)
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    rng = random.Random(20261201)
    completed = retries = resent = kills = 0
    started = time.perf_counter()
    with Supervisor(chaos_root, tmp_path) as supervisor:
        with WeightStreamClient(supervisor.target, progress=False, retry=POLICY) as client:
            baseline_started = time.perf_counter()
            client.load_into(module, MODEL)
            baseline = time.perf_counter() - baseline_started
            assert digests(_state(module)) == expected
            for load in range(KILLS):
                for p in module.parameters():
                    p.detach().zero_()
                with _Killer(supervisor, module, share=rng.uniform(0.1, 0.7)) as killer:
                    report = client.load_into(module, MODEL)
                assert killer.killed_at is not None, f"load {load} finished before the kill"
                assert report.retries >= 1, f"load {load}: the kill did not break the stream"
                got = digests(_state(module))
                bad = sorted(name for name, digest in expected.items() if got.get(name) != digest)
                record("summary", bytes_lost=sum(_nbytes(module, name) for name in bad))
                assert not bad, f"load {load}: {len(bad)} tensors differ, for example {bad[:3]}"
                completed += 1
                retries += report.retries
                resent += report.resent_bytes
            kills = supervisor.kills
        assert supervisor.starts == kills + 1, supervisor.log()
    seconds = time.perf_counter() - started
    record(
        "chaos",
        sigkill_loads_attempted=KILLS,
        sigkill_loads_completed=completed,
        server_kills=kills,
        sigkill_retries=retries,
        sigkill_resent_bytes=resent,
        sigkill_load_bytes=total,
        sigkill_clean_load_seconds=baseline,
        sigkill_test_seconds=seconds,
    )
    record("summary", faults_survived=kills, bytes_verified=completed * total)


def test_checkpoint_changed_while_the_server_was_down_stops_the_load(tmp_path: Path) -> None:
    """A shard rewritten between a kill and the restart: the load stops, nothing of the new version lands."""
    root = tmp_path / "models"
    folder = root / "changing"
    write_checkpoint(folder, 0.25)
    shard = sorted(folder.glob("*.safetensors"))[-1]
    new_version = {name: t.add(1) for name, t in load_file(str(shard)).items()}
    new_digests = digests(new_version)
    module = _module(folder)

    def rewrite() -> None:
        save_file(new_version, str(shard))  # same names, shapes and size; other bytes and mtime

    with Supervisor(root, tmp_path) as supervisor:
        supervisor.before_restart = rewrite
        with WeightStreamClient(supervisor.target, progress=False, retry=POLICY) as client:
            with _Killer(supervisor, module, share=0.3), pytest.raises(FailedPreconditionError) as info:
                client.load_into(module, "changing")
    message = str(info.value)
    assert "changed on the server during the load" in message, message
    assert info.value.partially_written is True
    assert "partly written" in message, message
    got = digests(_state(module))
    mixed = sorted(name for name, digest in new_digests.items() if got[name] == digest)
    assert not mixed, f"tensors of the new version were written: {mixed[:3]}"
    record("chaos", changed_checkpoint_refused=1)


@pytest.mark.parametrize("streams", [1, 2])
def test_connection_cut_mid_stream_through_a_proxy(
    model_root: Path, server: WeightStreamServer, streams: int, tmp_path: Path
) -> None:
    name = f"proxy-model-{streams}"
    state = write_model(model_root, name, tensors=32, numel=1 << 20, seed=streams)  # 128 MiB
    total = sum(t.numel() * t.element_size() for t in state.values())
    mib = 1 << 20
    plan = [(3 * mib, "reset"), (17 * mib, "reset"), (40 * mib, "reset"), (9 * mib, "reset")]
    module = ParameterTree({n: (tuple(t.shape), t.dtype) for n, t in state.items()})
    with CuttingProxy(server.port, plan) as proxy:
        with WeightStreamClient(proxy.target, progress=False, retry=POLICY, streams=streams) as client:
            report = client.load_into(module, name)
        assert proxy.cuts == len(plan)
        relayed = proxy.relayed
    want, got = digests(state), digests(_state(module))
    bad = sorted(name for name in want if got[name] != want[name])
    record("summary", bytes_lost=sum(_nbytes(module, name) for name in bad))
    assert not bad, f"{len(bad)} tensors differ, for example {bad[:3]}"
    assert report.retries >= len(plan)
    # Bytes the server sent that never landed: what was in flight at each cut. A resume that asked
    # for whole tensors again (or the whole model) would re-send far more.
    in_flight = relayed - total
    assert in_flight < total // 2, f"{in_flight} bytes relayed beyond the model's {total}"
    record(
        "chaos",
        proxy_loads_attempted=1,
        proxy_loads_completed=1,
        proxy_cuts=proxy.cuts,
        proxy_retries=report.retries,
        proxy_resent_bytes=report.resent_bytes,
        proxy_bytes_lost_in_flight=max(0, in_flight),
    )
    record("summary", faults_survived=proxy.cuts, bytes_verified=total)


class _Restarts:
    """Kills the supervised server at seeded random points of one load.

    Each planned kill waits until its share of the module's bytes has landed (shares drawn at
    random) and the server it kills has sent some of them, so that it breaks a stream; some are
    followed by one or two kills of the next server while it is still starting, each a random
    time after its start, so that one outage spans several restarts, and one by a crash loop of
    CRASH_LOOP such kills (an outage of about ten seconds, none of whose tries can reach a
    server). Progress is read from samples of the module's memory: it starts zeroed, and no
    element of the random checkpoint is zero.
    """

    def __init__(self, supervisor: Supervisor, module: torch.nn.Module, rng: random.Random, kills: int) -> None:
        self._supervisor = supervisor
        self._samples = [p.detach().view(-1)[::SAMPLE_STRIDE] for p in module.parameters()]
        self._sampled = sum(s.numel() for s in self._samples)
        shares = sorted(rng.uniform(0.02, 0.9) for _ in range(kills))
        self.plan = [
            (share, [rng.uniform(0.05, 1.5) for _ in range(rng.choices((0, 1, 2), weights=(5, 3, 2))[0])])
            for share in shares
        ]
        looping = rng.randrange(kills)
        self.plan[looping] = (shares[looping], [rng.uniform(0.05, 1.2) for _ in range(CRASH_LOOP)])
        self.kills_mid_stream = 0
        self.kills_starting = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-restarts", daemon=True)

    def landed_share(self) -> float:
        return sum(int(torch.count_nonzero(s)) for s in self._samples) / self._sampled

    def __enter__(self) -> _Restarts:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        for share, starting_after in self.plan:
            # What had landed when this server started (bytes the last one sent land late).
            floor = self.landed_share()
            while (now := self.landed_share()) < share or now <= floor:
                if self._done.wait(POLL_S):
                    return
            if self._supervisor.kill():
                self.kills_mid_stream += 1
            for delay in starting_after:
                if not self._supervisor.wait_started(self._supervisor.starts + 1) or self._done.wait(delay):
                    return
                if self._supervisor.kill():
                    self.kills_starting += 1
            if not self._supervisor.wait_started(self._supervisor.starts + 1):
                return


def test_default_policy_survives_many_restarts_in_one_load(
    chaos_root: Path, expected: dict[str, str], tmp_path: Path
) -> None:
    """Eight to fifteen SIGKILLs at random points of one load, each restart as slow as a real one.

    With the client's default RetryPolicy the load must end bit-exact, in a bounded time: the
    attempts of an outage are not burnt while the server is still starting.
    """
    module = _module(chaos_root / MODEL)
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    rng = random.Random(20261206)
    planned = rng.randint(4, 6)
    with Supervisor(chaos_root, tmp_path, restart_delay=RESTART_DELAY_S) as supervisor:
        with WeightStreamClient(supervisor.target, progress=False, retry=DEFAULT_POLICY) as client:
            started = time.monotonic()
            with _Restarts(supervisor, module, rng, planned) as restarts:
                report = client.load_into(module, MODEL)
            seconds = time.monotonic() - started
        kills = supervisor.kills
    got = digests(_state(module))
    bad = sorted(name for name, digest in expected.items() if got.get(name) != digest)
    record("summary", bytes_lost=sum(_nbytes(module, name) for name in bad))
    assert not bad, f"{len(bad)} tensors differ, for example {bad[:3]}"
    assert restarts.kills_mid_stream == planned, (restarts.kills_mid_stream, planned, supervisor.log())
    # Every kill mid-stream breaks the stream; no kill costs more than one try, because tries are
    # made once the channel connects, never against a server that is not there yet.
    assert planned <= report.retries <= kills, f"{report.retries} tries for {kills} kills"
    # Each kill costs the restart delay, the server's start-up and a reconnect; loading is quick.
    assert seconds < 5.0 * kills + 20.0, f"{kills} kills took {seconds:.1f} s"
    record(
        "chaos",
        default_policy_kills_survived=kills,
        default_policy_kills_while_starting=restarts.kills_starting,
        default_policy_retries=report.retries,
        default_policy_load_seconds=seconds,
    )
    record("summary", faults_survived=kills, bytes_verified=total)


def test_default_policy_waits_out_a_server_down_for_half_a_minute(
    chaos_root: Path, expected: dict[str, str], tmp_path: Path
) -> None:
    """Killed mid-load and started again LONG_OUTAGE_S later: the outage budget bounds the wait, not the tries."""
    module = _module(chaos_root / MODEL)
    with Supervisor(chaos_root, tmp_path, restart_delay=LONG_OUTAGE_S) as supervisor:
        with WeightStreamClient(supervisor.target, progress=False, retry=DEFAULT_POLICY) as client:
            started = time.monotonic()
            with _Killer(supervisor, module, share=0.3) as killer:
                report = client.load_into(module, MODEL)
            seconds = time.monotonic() - started
        assert supervisor.kills == 1 and supervisor.starts == 2, supervisor.log()
    assert killer.killed_at is not None, "the load finished before the kill"
    got = digests(_state(module))
    bad = sorted(name for name, digest in expected.items() if got.get(name) != digest)
    assert not bad, f"{len(bad)} tensors differ, for example {bad[:3]}"
    assert LONG_OUTAGE_S <= seconds < LONG_OUTAGE_S + 15, f"the load took {seconds:.1f} s"
    # The tries that reached no server were waiting, not tries: one resume after the restart.
    assert report.retries <= 2, report
    record("chaos", default_policy_outage_waited_seconds=seconds, default_policy_outage_retries=report.retries)
    record("summary", faults_survived=1, bytes_verified=report.bytes)
