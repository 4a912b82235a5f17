"""The weightsync propagation model: hand-computable cases, orderings that must hold, input
checks, and the ``meridian simulate weightsync`` command."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meridian import cli
from services.weightsync import simulation as sim
from services.weightsync.simulation import CodecRates, Link, ModelLayout, SimConfig, SimulationError, Topology

FAST = 1e18  # bytes/s: a stage that takes no time
#: Only the links cost time: every codec stage free, no per-message cost, encoded = raw.
LINKS_ONLY = CodecRates(
    encode_bytes_s=FAST,
    decode_bytes_s=FAST,
    decode_copy_bytes_s=FAST,
    weights_hash_bytes_s=FAST,
    sha256_bytes_s=FAST,
    persist_bytes_s=FAST,
    delta_fraction=1.0,
    message_overhead_s=0.0,
    receive_chunk_s=0.0,
    decode_chunk_s=0.0,
    send_chunk_s=0.0,
    send_message_s=0.0,
    send_byte_s=0.0,
    version_tensor_s=0.0,
    manifest_chunk_bytes=0.0,
    manifest_tensor_bytes=0.0,
    source="test",
)
NO_LAN = Link(FAST, 0.0)


def _one_chunk(raw_bytes: int = 2000) -> ModelLayout:
    return ModelLayout("one", ((1, raw_bytes // 2),))


def _served(config: SimConfig) -> float:
    return sim.simulate(config)["served_everywhere_s"]


def test_one_link_one_chunk_is_latency_plus_size_over_bandwidth() -> None:
    bandwidth, latency = 1e6, 0.02
    # The subscriber sits next to the origin: its LAN link is the only link.
    topology = Topology(regions=1, subscribers_per_region=1, lan=Link(bandwidth, latency))
    report = sim.simulate(SimConfig(_one_chunk(), topology, LINKS_ONLY, mode="current"))
    assert report["served_everywhere_s"] == pytest.approx(latency + 2000 / bandwidth, rel=1e-9)
    assert report["model"]["chunks"] == 1
    # Across regions: origin -> WAN -> relay -> (free) LAN -> subscriber.
    topology = Topology(regions=2, subscribers_per_region=1, origin_subscribers=0, wan=Link(bandwidth, latency), lan=NO_LAN, nic_bytes_s=FAST)
    for mode in sim.MODES:
        report = sim.simulate(SimConfig(_one_chunk(), topology, LINKS_ONLY, mode=mode))
        assert report["served_everywhere_s"] == pytest.approx(latency + 2000 / bandwidth, rel=1e-6)
        assert report["link_bound_s"] == pytest.approx(latency + 2000 / bandwidth, rel=1e-9)
        assert {k for k, v in report["where_the_time_goes"].items() if v > 1e-9} == {"WAN transfer", "WAN latency"}


def test_loop_costs_per_chunk_message_and_byte_in_the_current_mode() -> None:
    rates = LINKS_ONLY.replace(send_chunk_s=1e-3, send_message_s=10e-3, send_byte_s=1e-6, receive_chunk_s=2e-3, decode_chunk_s=3e-3)
    model = ModelLayout("two", ((2, 1000),))  # two tensors: two chunks of 2000 bytes
    topology = Topology(regions=1, subscribers_per_region=1, lan=Link(FAST, 0.0))
    # A segment per chunk: each is sent alone (1 + 10 + 2 ms), the receiver takes each as
    # it comes (2 + 3 ms): the last is in at 2 * 13 + 5 ms.
    report = sim.simulate(SimConfig(model, topology, rates, mode="current"))
    assert report["served_everywhere_s"] == pytest.approx(31e-3, rel=1e-6)
    # Both chunks held at once: coalesced into one message of 64 KiB at most.
    report = sim.simulate(SimConfig(model, topology, rates, mode="current", max_segments=1))
    assert report["served_everywhere_s"] == pytest.approx((2 + 10 + 4 + 2 * 5) * 1e-3, rel=1e-6)
    # Messages of at most one chunk: two messages.
    report = sim.simulate(SimConfig(model, topology, rates, mode="current", max_segments=1, message_bytes=2000))
    assert report["served_everywhere_s"] == pytest.approx((2 + 20 + 4 + 2 * 5) * 1e-3, rel=1e-6)
    # The fitted contention of one process on two cores counts only in that setting.
    contended = rates.replace(message_overhead_s=7e-3)
    assert sim.simulate(SimConfig(model, topology, contended, mode="current", max_segments=1))["served_everywhere_s"] == pytest.approx(26e-3)
    report = sim.simulate(SimConfig(model, topology, contended, mode="current", max_segments=1, single_process=True))
    assert report["served_everywhere_s"] == pytest.approx((26 + 4 * 7) * 1e-3, rel=1e-6)  # 2 chunks, both sides
    # Per version, each receiver's start and hash check: per tensor, on its event loop.
    per_tensor = rates.replace(version_tensor_s=4e-3)
    report = sim.simulate(SimConfig(model, topology, per_tensor, mode="current", max_segments=1))
    assert report["served_everywhere_s"] == pytest.approx((26 + 2 * 4) * 1e-3, rel=1e-6)
    assert report["where_the_time_goes"]["version (per tensor)"] == pytest.approx(8e-3)


def test_signed_versions_cost_each_receiver_a_hash_of_the_weights() -> None:
    # 4000 raw bytes: 4 ms on one thread; the chunks' own checksums next to nothing.
    rates = LINKS_ONLY.replace(sha256_bytes_s=1e6, delta_fraction=1e-6)
    model = ModelLayout("two", ((2, 1000),))
    topology = Topology(regions=2, subscribers_per_region=1, origin_subscribers=0, wan=Link(FAST, 0.0), lan=NO_LAN, nic_bytes_s=FAST)
    plain = sim.simulate(SimConfig(model, topology, rates, mode="current", cores=1))["served_everywhere_s"]
    signed = sim.simulate(SimConfig(model, topology, rates, mode="current", cores=1, signed=True))["served_everywhere_s"]
    # Each receiver hashes a tensor (2 ms) as it is decoded. The relay passes the first
    # chunk on at once and the last only once both tensors are hashed (4 ms); the
    # subscriber hashes the first meanwhile and the last after it (6 ms).
    assert signed - plain == pytest.approx(6e-3, rel=1e-3)
    # Two cores: the relay hashes both tensors at once (2 ms), the subscriber's first
    # while the relay's last, then its last (4 ms).
    two = sim.simulate(SimConfig(model, topology, rates, mode="current", cores=2, signed=True))["served_everywhere_s"]
    assert two - plain == pytest.approx(4e-3, rel=1e-3)


def test_pipelined_is_never_slower_and_the_critical_path_adds_up() -> None:
    topology = Topology(regions=3, subscribers_per_region=2, wan=Link.gbit(1, 50))
    for size in ("135m", "8b"):
        reports = {mode: sim.simulate(SimConfig(sim.model_layout(size), topology, mode=mode, cores=8, max_segments=64)) for mode in sim.MODES}
        assert reports["pipelined"]["served_everywhere_s"] < reports["current"]["served_everywhere_s"]
        for r in reports.values():
            assert sum(r["where_the_time_goes"].values()) == pytest.approx(r["served_everywhere_s"], rel=1e-6)
            assert r["served_everywhere_s"] >= r["link_bound_s"]
            served = [x["all_served_s"] for x in r["regions"]]
            assert max(served) == pytest.approx(r["served_everywhere_s"])


def test_the_current_origin_encodes_the_whole_version_before_sending() -> None:
    rates = LINKS_ONLY.replace(encode_bytes_s=1e6)  # 2000 raw bytes: 2 ms of encoding
    topology = Topology(regions=1, subscribers_per_region=1, lan=Link(1e6, 0.0))
    model = ModelLayout("two", ((2, 500),))  # two chunks of 1000 bytes
    current = sim.simulate(SimConfig(model, topology, rates, mode="current", cores=1))
    assert current["available_at_origin_s"] == pytest.approx(2e-3)
    assert current["served_everywhere_s"] == pytest.approx(2e-3 + 2e-3)  # then both chunks over the link
    # Two cores: the two tensors are encoded at once.
    assert sim.simulate(SimConfig(model, topology, rates, mode="current", cores=2))["available_at_origin_s"] == pytest.approx(1e-3)
    # Pipelined, one core: chunk 1 goes out while chunk 2 is encoded.
    piped = sim.simulate(SimConfig(model, topology, rates, mode="pipelined", cores=1))
    assert piped["served_everywhere_s"] == pytest.approx(1e-3 + 2e-3)


def test_ranks_that_encode_leave_the_origin_a_decode_and_its_per_chunk_python() -> None:
    # 4000 raw bytes in two tensors: 4 ms of encoding on one core; decoding 1 ms (in
    # place: each receiver, the origin too); 2 ms of GIL-held Python per chunk; the link free.
    rates = LINKS_ONLY.replace(encode_bytes_s=1e6, decode_bytes_s=4e6, decode_chunk_s=2e-3)
    model = ModelLayout("two", ((2, 1000),))
    topology = Topology(regions=1, subscribers_per_region=1, lan=NO_LAN, nic_bytes_s=FAST)
    origin = sim.simulate(SimConfig(model, topology, rates, mode="current", cores=1))
    assert origin["available_at_origin_s"] == pytest.approx(4e-3)
    # The trainer's 4 cores encode the two tensors at once (2 ms); the origin's one core
    # decodes both (1 ms) while its GIL takes both chunks' Python (4 ms): 6 ms.
    ranks = sim.simulate(SimConfig(model, topology, rates, mode="current", cores=1, origin_cores=4, rank_encode=True))
    assert ranks["available_at_origin_s"] == pytest.approx(6e-3)
    assert ranks["where_the_time_goes"]["encode"] == pytest.approx(2e-3)
    # The subscriber pays the same per-chunk Python again (4 ms more on the path).
    assert ranks["where_the_time_goes"]["decode (per chunk, GIL)"] == pytest.approx(8e-3, rel=1e-6)
    # Without the per-chunk Python the decode on the origin's cores is what is left.
    quick = sim.simulate(SimConfig(model, topology, rates.replace(decode_chunk_s=0.0), mode="current", cores=1, origin_cores=4, rank_encode=True))
    assert quick["available_at_origin_s"] == pytest.approx(3e-3)


def test_more_regions_are_never_faster() -> None:
    for mode in sim.MODES:
        times = [
            _served(
                SimConfig(sim.model_layout("8b"), Topology(regions=r, subscribers_per_region=2, wan=Link.gbit(1, 20)), mode=mode, cores=16, max_segments=32)
            )
            for r in range(1, 5)
        ]
        assert times == sorted(times), (mode, times)


def test_doubling_the_bandwidth_halves_the_transfer() -> None:
    latency = 0.03
    model = ModelLayout("m", ((8, 1 << 20),))  # 8 chunks of 2 MiB raw
    times = []
    for bandwidth in (1e8, 2e8):
        topology = Topology(regions=2, subscribers_per_region=1, origin_subscribers=0, wan=Link(bandwidth, latency), lan=NO_LAN, nic_bytes_s=FAST)
        r = sim.simulate(SimConfig(model, topology, LINKS_ONLY, mode="pipelined"))
        times.append(r["served_everywhere_s"] - latency)
        assert r["where_the_time_goes"]["WAN transfer"] == pytest.approx(8 * 2 * (1 << 20) / bandwidth, rel=1e-6)
    assert times[1] == pytest.approx(times[0] / 2, rel=1e-6)


def test_a_small_window_limits_a_long_link() -> None:
    link = Link(1e9, 0.05, window_bytes=1e6)  # one MB per 100 ms round trip
    assert link.rate == pytest.approx(1e7)
    assert Link(1e9, 0.05).rate == 1e9
    model = ModelLayout("m", ((4, 1 << 20),))
    times = {}
    for window in (None, 1e6):
        topology = Topology(regions=2, subscribers_per_region=1, origin_subscribers=0, wan=Link(1e9, 0.05, window), lan=NO_LAN, nic_bytes_s=FAST)
        times[window] = {mode: _served(SimConfig(model, topology, LINKS_ONLY, mode=mode)) for mode in sim.MODES}
    assert times[1e6]["current"] == pytest.approx(0.05 + 8 * (1 << 20) / 1e7, rel=1e-6)  # window-bound
    assert times[1e6]["pipelined"] == pytest.approx(times[None]["pipelined"])  # the design's window is the BDP


def test_shared_nic_slows_a_wide_fan_out() -> None:
    base = Topology(regions=1, subscribers_per_region=1, lan=Link.gbit(10, 0.1))
    wide = dataclasses.replace(base, subscribers_per_region=8)
    model = sim.model_layout("1b")
    one = _served(SimConfig(model, base, mode="pipelined", cores=64, max_segments=32))
    eight = _served(SimConfig(model, wide, mode="pipelined", cores=64, max_segments=32))
    assert eight > one


def test_layouts_match_the_encoder() -> None:
    small = sim.PRESETS["135m"]
    assert small.tensors == 272  # SmolLM2-135M: 30 layers of 9 tensors, embeddings, final norm
    assert small.params == 134_515_008
    # 4 MiB chunks: one per tensor of a layer, 14 for the 49152 x 576 embeddings.
    assert small.chunks(4 << 20) == 270 + 14 + 1
    assert 0.95e12 < sim.PRESETS["1t"].params < 1.1e12
    scaled = sim.model_layout("3b")
    assert scaled.params == pytest.approx(3e9, rel=1e-3)
    assert sim.parse_params("1.5B") == 1.5e9 and sim.parse_params("135m") == 135e6 and sim.parse_params("2e9") == 2e9


def test_segments_keep_every_chunk_and_byte() -> None:
    for size in ("135m", "1t"):
        model = sim.model_layout(size)
        segs = sim._segments(model, 4 << 20, 64)
        assert len(segs) <= 64 + 1
        assert sum(n for n, _, _ in segs) == model.chunks(4 << 20)
        assert sum(raw for _, raw, _ in segs) == pytest.approx(model.raw_bytes)
        assert sum(share for _, _, share in segs) == pytest.approx(model.raw_bytes)


def test_density_puts_the_bytes_where_they_are() -> None:
    """Two equal tensors, the first with 1.8x the average encoded bytes per raw byte (a
    dense embedding delta), the second 0.2x: the version's bytes are the same, but they
    come first, so the second tensor's decode waits behind most of the transfer. Hand
    numbers: 1000 raw bytes per tensor, encoded = raw, a 1000 B/s WAN link to the
    subscriber's relay, 1 s of decode per tensor on one core: light first, its decode
    overlaps the dense tensor's 1.8 s of transfer, served at 2 + 1 s; dense first, the
    light one's 0.2 s of transfer overlaps the dense one's decode, served at 1.8 + 1 + 1 s."""
    rates = LINKS_ONLY.replace(decode_bytes_s=1000.0)
    topology = Topology(regions=2, subscribers_per_region=1, origin_subscribers=0, wan=Link(1000.0, 0.0), lan=NO_LAN, nic_bytes_s=FAST)
    groups = ((1, 500), (1, 500))

    def served(density: tuple[float, float]) -> float:
        model = ModelLayout("two", groups, density)
        segs = sim._segments(model, 1000, 2)
        assert [share for _, _, share in segs] == pytest.approx([1000 * d for d in density])
        return _served(SimConfig(model, topology, rates, mode="current", cores=1, max_segments=2))

    assert served((0.2, 1.8)) == pytest.approx(3.0, rel=1e-6)
    assert served((1.8, 0.2)) == pytest.approx(3.8, rel=1e-6)
    assert _served(SimConfig(ModelLayout("two", groups), topology, rates, mode="current", cores=1, max_segments=2)) == pytest.approx(3.0, rel=1e-6)
    with pytest.raises(SimulationError, match="densities"):
        ModelLayout("two", groups, (1.0,))


def test_the_manifest_crosses_every_link_before_the_chunks() -> None:
    """A version's manifest (600 bytes for its chunk, 400 for its tensor here) goes ahead
    of its chunks on each hop (current), or its tensor part ahead and the chunk's reference
    with the chunk (pipelined): the same 1000 bytes on the link either way."""
    bandwidth, latency = 1e6, 0.02
    rates = LINKS_ONLY.replace(manifest_chunk_bytes=600.0, manifest_tensor_bytes=400.0)
    topology = Topology(regions=2, subscribers_per_region=1, origin_subscribers=0, wan=Link(bandwidth, latency), lan=NO_LAN, nic_bytes_s=FAST)
    for mode in sim.MODES:
        report = sim.simulate(SimConfig(_one_chunk(), topology, rates, mode=mode))
        assert report["served_everywhere_s"] == pytest.approx(latency + (1000 + 2000) / bandwidth, rel=1e-6), mode
        assert report["model"]["manifest_bytes"] == 1000
        assert report["link_bound_s"] == pytest.approx(latency + 2000 / bandwidth, rel=1e-9)  # the version's own bytes
    current = sim.simulate(SimConfig(_one_chunk(), topology, rates, mode="current"))["where_the_time_goes"]
    assert current["WAN transfer (manifest)"] == pytest.approx(1000 / bandwidth)
    # Over a LAN too (the subscriber next to the origin): through the sender's NIC, or
    # through a link slower than that NIC, the manifest first.
    for nic in (None, FAST):
        lan = Topology(regions=1, subscribers_per_region=1, lan=Link(bandwidth, latency), nic_bytes_s=nic)
        assert _served(SimConfig(_one_chunk(), lan, rates, mode="current")) == pytest.approx(latency + 3000 / bandwidth, rel=1e-6), nic


def test_bytes_per_day() -> None:
    topology = Topology(regions=4, subscribers_per_region=1, wan=Link.gbit(10, 50))
    r = sim.simulate(SimConfig(sim.model_layout("135m"), topology, mode="current", version_interval_s=60))
    per_day = r["bytes_per_day"]
    model = r["model"]
    rates = sim.DEFAULT_RATES
    assert model["manifest_bytes"] == pytest.approx(model["chunks"] * rates.manifest_chunk_bytes + model["tensors"] * rates.manifest_tensor_bytes, abs=1)
    # (The report rounds the per-version figures to whole bytes.)
    assert per_day["per_wan_link"] == pytest.approx((model["encoded_bytes"] + model["manifest_bytes"]) * 1440, abs=2 * 1440)
    assert per_day["wan_links"] == 3 and per_day["lan_links"] == 4
    assert per_day["origin_egress"] == pytest.approx(per_day["per_wan_link"] * 4)  # three relays and its own subscriber
    assert per_day["keeps_up"]


@pytest.mark.parametrize(
    "build",
    [
        lambda: Link(0, 0.01),
        lambda: Link(1e9, -1),
        lambda: Link(1e9, 0.01, window_bytes=0),
        lambda: Topology(regions=0),
        lambda: Topology(regions=1, subscribers_per_region=0),
        lambda: Topology(local_relays=-1),
        lambda: LINKS_ONLY.replace(delta_fraction=0),
        lambda: LINKS_ONLY.replace(encode_bytes_s=float("nan")),
        lambda: SimConfig(_one_chunk(), Topology(), mode="fast"),
        lambda: SimConfig(_one_chunk(), Topology(), cores=0),
        lambda: ModelLayout("empty", ()),
        lambda: sim.parse_params("lots"),
        lambda: sim.model_layout("1e20"),
        lambda: sim.rates_from_bench({"summary": {}}),
    ],
)
def test_bad_inputs_raise_clear_errors(build: object) -> None:
    with pytest.raises(SimulationError, match=r"\w+"):
        build()  # type: ignore[operator]


def test_rates_from_a_bench_result() -> None:
    result = {"summary": {"encode_gbps": 0.5, "decode_gbps": 3.0, "decode_copy_gbps": 0.8, "ours_pct_of_full": 0.12}}
    rates = sim.rates_from_bench(result)
    assert rates.encode_bytes_s == 0.5e9 and rates.decode_bytes_s == 3e9 and rates.decode_copy_bytes_s == 0.8e9
    assert rates.delta_fraction == pytest.approx(0.0012)
    assert rates.message_overhead_s == sim.DEFAULT_RATES.message_overhead_s
    # The CPU-time decode figure, when the bench has one, is the per-core rate.
    assert sim.rates_from_bench({"summary": {**result["summary"], "decode_gbps_cpu": 4.0}}).decode_bytes_s == 4e9
    # So is the per-chunk part of an apply.
    assert rates.decode_chunk_s == sim.DEFAULT_RATES.decode_chunk_s
    assert sim.rates_from_bench({"summary": {**result["summary"], "decode_chunk_us": 25.0}}).decode_chunk_s == pytest.approx(25e-6)


def test_frontier_figures_name_both_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sim.FRONTIER, "params", "1b")  # small enough for a unit test
    figures = sim.frontier_figures()
    assert figures["t_1t_4regions_10gbit_s"] == figures["current"]["served_everywhere_s"]
    assert figures["t_1t_4regions_10gbit_s_pipelined"] == figures["pipelined"]["served_everywhere_s"]
    assert figures["t_1t_4regions_10gbit_s_pipelined"] < figures["t_1t_4regions_10gbit_s"]
    assert figures["pipelined_origin_cores_for_target"] is None or figures["pipelined_origin_cores_for_target"] >= 1
    assert "pipelined_subscriber_cores_for_target" not in sim.frontier_figures(search_cores=False)
    # The service's default flags (origin encoding, small chunks and messages, no local relays) are slower.
    assert figures["current_default_flags"]["flags"] == sim.FRONTIER_DEFAULTS
    assert figures["t_1t_4regions_10gbit_s_default_flags"] > figures["t_1t_4regions_10gbit_s"]


def test_cli_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "weightsync", "--params", "135m", "--regions", "2", "--subscribers", "2", "--mode", "serial", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "current" and report["topology"]["regions"] == 2 and report["topology"]["subscribers"] == 4
    assert report["served_everywhere_s"] > report["propagation_s"] > 0
    assert cli.main(["simulate", "weightsync", "--params", "135m", "--link-gbit", "1", "--latency-ms", "150"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert set(both) == {"current", "pipelined"} and both["current"]["topology"]["wan_latency_ms"] == 150


def test_cli_sweep_prints_rows(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim, "SWEEP", {"params": ("135m",), "regions": (1, 4), "wan_gbit_s": (1.0, 10.0), "latency_ms": (20.0,)})
    assert cli.main(["simulate", "weightsync", "--sweep", "--mode", "pipelined"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 4 and {r["regions"] for r in rows} == {1, 4} and all(r["mode"] == "pipelined" for r in rows)


def test_cli_rejects_bad_flags(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate", "weightsync", "--regions", "0"])
    assert exc.value.code == 2
    assert "regions must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["simulate", "weightsync", "--rates-from", "/nonexistent/bench.json"])
    assert "--rates-from" in capsys.readouterr().err
