"""The change builder's CPU per change, without a server, and against another checkout (see bench/README.md).

Synthetic pgoutput messages of one 6-column table (key, 5 short text values, 10% NULL) are fed
to ChangeBuilder.batches in blocks of 5,000 messages, as a task feeds a peek, in four scenarios:
  runs   transactions of 1,000 changes: 50% inserts, 30% updates, 20% deletes (the vectorised path)
  small  transactions of 2 changes (every change goes the per-message path)
  full   as runs, under REPLICA IDENTITY FULL: updates and deletes carry the old row ('O')
  key    as runs, but every update changes the key (an old key tuple 'K')
Each run is a fresh process per source tree (`--against DIR`: another checkout's `src`), the trees
taking turns at going first; a process times each scenario `--repeat` times and keeps the fastest.
Prints medians and spreads per tree, and the per-run ratios this tree / the other.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

OID = 16384
COLUMNS = 6
SIZES = {"runs": 400_000, "small": 150_000, "full": 100_000, "key": 100_000}
SCENARIOS = {"runs": ("plain", 1000), "small": ("plain", 2), "full": ("full", 1000), "key": ("key", 1000)}
SRC = Path(__file__).resolve().parent.parent / "src"


def tuple_data(values: list[bytes | None]) -> bytes:
    out = bytearray(struct.pack(">h", len(values)))
    for v in values:
        out += b"n" if v is None else b"t" + struct.pack(">i", len(v)) + v
    return bytes(out)


def relation(identity: bytes) -> bytes:
    columns = b"".join(bytes([i == 0]) + f"c{i}".encode() + b"\0" + struct.pack(">Ii", 25, -1) for i in range(COLUMNS))
    return b"R" + struct.pack(">I", OID) + b"public\0t\0" + identity + struct.pack(">h", COLUMNS) + columns


def row(rng: random.Random, key: int) -> list[bytes | None]:
    return [str(key).encode(), *(None if rng.random() < 0.1 else f"v{rng.randrange(10**6)}".encode()
                                 for _ in range(COLUMNS - 1))]


def change(rng: random.Random, mode: str, key: int) -> bytes:
    head, r = struct.pack(">I", OID), rng.random()
    if r < 0.5:
        return b"I" + head + b"N" + tuple_data(row(rng, key))
    if r < 0.8:
        if mode == "full":
            return b"U" + head + b"O" + tuple_data(row(rng, key)) + b"N" + tuple_data(row(rng, key))
        if mode == "key":
            old_key = tuple_data([str(key + 1).encode()] + [None] * (COLUMNS - 1))
            return b"U" + head + b"K" + old_key + b"N" + tuple_data(row(rng, key))
        return b"U" + head + b"N" + tuple_data(row(rng, key))
    if mode == "full":
        return b"D" + head + b"O" + tuple_data(row(rng, key))
    return b"D" + head + b"K" + tuple_data([str(key).encode()] + [None] * (COLUMNS - 1))


def blocks(mode: str, changes: int, per_txn: int) -> list[list[bytes]]:
    rng = random.Random(7)
    messages = [relation(b"f" if mode == "full" else b"d")]
    lsn, key = 1000, 0
    while key < changes:
        lsn += 100
        messages.append(b"B" + struct.pack(">QqI", lsn, 1000 + key, key + 1))
        for _ in range(per_txn):
            key += 1
            messages.append(change(rng, mode, key))
        messages.append(b"C" + struct.pack(">BQQq", 0, lsn, lsn + 50, 1000 + key))
    return [messages[i:i + 5000] for i in range(0, len(messages), 5000)]


def worker(scale: float, repeat: int) -> None:
    """Time each scenario with the ChangeBuilder of the source tree on sys.path; print JSON."""
    try:
        builder = importlib.import_module("changefeed.postgres.decode.builder")
    except ImportError:  # a checkout from before postgres/decode/
        builder = importlib.import_module("changefeed.postgres.changes")
    times = {}
    for name, (mode, per_txn) in SCENARIOS.items():
        messages, best = blocks(mode, int(SIZES[name] * scale), per_txn), float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            for _ in builder.ChangeBuilder(0, 1 << 62, 0, 1 << 62).batches(messages):
                pass
            best = min(best, time.perf_counter() - t)
        times[name] = best
    print(json.dumps(times))


def run(src: Path, scale: float, repeat: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, __file__, "--worker", f"--scale={scale}", f"--repeat={repeat}"],
                         env=env, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out))


def fmt(xs: list[float], unit: float = 1.0) -> str:
    return f"{statistics.median(xs) * unit:.3f} [{min(xs) * unit:.3f} - {max(xs) * unit:.3f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", type=Path, help="another checkout's src directory, to compare with")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3, help="timings per scenario in a process (the fastest counts)")
    p.add_argument("--scale", type=float, default=1.0, help="times the default number of changes")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.scale, a.repeat)
        return
    trees = [SRC] + ([a.against.resolve()] if a.against else [])
    results: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    for i in range(a.runs):
        for tree in trees[i % len(trees):] + trees[:i % len(trees)]:
            results[tree].append(run(tree, a.scale, a.repeat))
            print(f"run {i + 1} {tree}: {results[tree][-1]}", flush=True)
    for name in SCENARIOS:
        n = int(SIZES[name] * a.scale)
        print(f"\n{name} ({n:,} changes): seconds, median [min - max]; µs per change")
        for tree in trees:
            xs = [r[name] for r in results[tree]]
            print(f"  {tree}: {fmt(xs)}  {statistics.median(xs) / n * 1e6:.2f} µs")
        if a.against:
            ratios = [x[name] / y[name] for x, y in zip(results[SRC], results[trees[1]])]
            print(f"  ratio this / other, per run: {fmt(ratios)}")


if __name__ == "__main__":
    main()
