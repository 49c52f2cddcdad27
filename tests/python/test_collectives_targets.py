"""benchmarks/collectives.py's targets: which shm all-reduce targets hold, and at how many sizes the hand-over between
two cores would meet them itself, on rows made up by hand."""
import sys

from test_torchrun import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import collectives  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def rows_for(world: int, shm_us: dict, gloo_us: dict, handover_us: dict, memcpy_gbps: float) -> list[dict]:
    rows = []
    for size in shm_us:
        for backend, micros in (("shm", shm_us[size]), ("gloo", gloo_us[size])):
            rows.append(dict(op="allreduce", world=world, backend=backend, bytes=size, seconds=micros * 1e-6,
                             p90_seconds=micros * 1.1e-6,
                             busbw_gbps=size / (micros * 1e-6) * collectives.bus_factor("allreduce", world) / 1e9))
        rows.append(dict(op="memcpy", world=1, backend="memcpy", bytes=size, seconds=size / memcpy_gbps / 1e9,
                         busbw_gbps=memcpy_gbps))
        if size in handover_us:
            rows.append(dict(op="handover", world=world, backend="memcpy", bytes=size,
                             seconds=handover_us[size] * 1e-6, busbw_gbps=size / (handover_us[size] * 1e-6) / 1e9))
    return rows


def check(checks: list[dict], world: int, target_start: str) -> dict:
    return next(c for c in checks if c["world"] == world and c["target"].startswith(target_start))


def test_the_hand_over_says_where_a_target_is_out_of_reach():
    # 64 KiB: shm 20 us against Gloo's 300 (15x), the hand-over 10 us (30x): both hold.
    # 256 KiB: shm 60 us against Gloo's 500 (8.3x), the hand-over 40 us (12.5x): within its reach.
    # 1 MiB: shm 150 us against Gloo's 1000 (6.7x); the hand-over 120 us (8.3x): out of its reach too.
    # 16 MiB: busbw 16 MiB / 2 ms = 8.4 GB/s of memcpy's 10 (84%: holds); the hand-over 2.5 ms (67%: would not).
    # 32 MiB: beyond the sizes where the hand-over is the reference, so not counted for it.
    shm = {64 * KiB: 20, 256 * KiB: 60, 1 * MiB: 150, 16 * MiB: 2000, 32 * MiB: 5000}
    gloo = {64 * KiB: 300, 256 * KiB: 500, 1 * MiB: 1000, 16 * MiB: 9000, 32 * MiB: 20000}
    handover = {64 * KiB: 10, 256 * KiB: 40, 1 * MiB: 120, 16 * MiB: 2500, 32 * MiB: 2500}
    checks = collectives.targets(rows_for(2, shm, gloo, handover, memcpy_gbps=10.0))

    speedup = check(checks, 2, ">= 10x Gloo")
    assert (speedup["held"], speedup["of"], speedup["holds"]) == (1, 3, False)
    assert (speedup["bound_held"], speedup["bound_of"]) == (2, 3)
    assert speedup["at_bytes"] == 1 * MiB

    bandwidth = check(checks, 2, "busbw >= 80%")
    assert (bandwidth["held"], bandwidth["of"]) == (1, 2)  # 16 MiB holds, 32 MiB (6.7 GB/s) does not
    assert (bandwidth["bound_held"], bandwidth["bound_of"]) == (0, 1)

    assert check(checks, 2, "p90")["bound_held"] is None  # no reference for the tail or the doublings
    table = collectives.targets_table(checks)
    assert "| 1 of 3 | no | 2 of 3 |" in table and "| yes | — |" in table


def test_more_ranks_than_two_have_no_hand_over_reference():
    shm, gloo = {64 * KiB: 20, 1 * MiB: 90}, {64 * KiB: 300, 1 * MiB: 1000}
    checks = collectives.targets(rows_for(3, shm, gloo, {64 * KiB: 10, 1 * MiB: 80}, memcpy_gbps=10.0))
    speedup = check(checks, 3, ">= 10x Gloo")
    assert (speedup["held"], speedup["holds"], speedup["bound_held"]) == (2, True, None)
    assert collectives.against_handover(rows_for(3, shm, gloo, {}, memcpy_gbps=10.0)) == ""


def test_the_all_reduce_against_the_hand_over_of_its_bytes():
    rows = rows_for(2, {1 * MiB: 150}, {1 * MiB: 1000}, {1 * MiB: 120}, memcpy_gbps=10.0)
    assert "| 1 MiB | 150.0 µs | 120.0 µs | 1.25 |" in collectives.against_handover(rows)
