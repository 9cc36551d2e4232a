"""Snapshot requests on the feed's first source node (postgres/requests.py): numbered per feed,
never two with one number however many hosts add at once, read above a number, and a state
folder's request files of an older changefeed taken in with their numbers."""
from __future__ import annotations

import threading
from pathlib import Path

from changefeed.core.requests import Request, SnapshotRequests
from changefeed.postgres.requests import SourceRequests
from support.servers import Dbs


def test_requests_are_numbered_per_feed_and_read_above_a_number(dbs: Dbs) -> None:
    with dbs.src() as c:
        mine, other = SourceRequests(lambda: c, dbs.name), SourceRequests(lambda: c, dbs.name + "x")
        assert mine.after(0) == []  # no table yet: nothing asked, nothing made
        assert mine.add(["public.a"]) == 1
        assert mine.add(["public.b", "public.c"]) == 2
        assert other.add(["public.z"]) == 1
        assert mine.after(0) == [Request(1, ["public.a"]), Request(2, ["public.b", "public.c"])]
        assert mine.after(1) == [Request(2, ["public.b", "public.c"])] and mine.after(2) == []
        assert other.after(0) == [Request(1, ["public.z"])]


def test_hosts_adding_at_once_never_share_a_number(dbs: Dbs) -> None:
    got: list[int] = []
    lock = threading.Lock()

    def add(n: int) -> None:
        with dbs.src() as c:
            requests = SourceRequests(lambda: c, dbs.name)
            for i in range(10):
                no = requests.add([f"public.t{n}_{i}"])
                with lock:
                    got.append(no)

    with dbs.src() as c:
        SourceRequests(lambda: c, dbs.name).add(["public.first"])  # the table made before the race
    threads = [threading.Thread(target=add, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(2, 42))
    with dbs.src() as c:
        assert [r.no for r in SourceRequests(lambda: c, dbs.name).after(0)] == list(range(1, 42))


def test_a_state_folders_requests_are_taken_in_with_their_numbers(dbs: Dbs, tmp_path: Path) -> None:
    folder = tmp_path / "requests"
    old = SnapshotRequests(folder)
    old.add(["public.a"])
    old.add(["public.b"])
    with dbs.src() as c:
        requests = SourceRequests(lambda: c, dbs.name, folder)
        assert requests.after(1) == [Request(2, ["public.b"])]  # read from the folder while the source has no table
        assert requests.add(["public.c"]) == 3  # the folder's two first, then the new one
        assert SourceRequests(lambda: c, dbs.name).after(0) == [Request(1, ["public.a"]), Request(2, ["public.b"]),
                                                                 Request(3, ["public.c"])]


def test_a_request_made_for_a_later_batch_is_due_only_from_there_and_an_older_table_takes_the_column(
        dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE SCHEMA IF NOT EXISTS changefeed")
        c.execute("CREATE TABLE changefeed.snapshot_requests (feed text NOT NULL, no int NOT NULL, tables jsonb "
                  "NOT NULL, made_at timestamptz NOT NULL DEFAULT clock_timestamp(), PRIMARY KEY (feed, no))")
        requests = SourceRequests(lambda: c, dbs.name)  # a table of the first version: neither later column
        assert requests.add(["public.a"]) == 1
        assert requests.add(["public.b"], after={"n1": 500, "n2": 70}) == 2
        first, second = requests.after(0)
        assert first.after == () and first.due({})
        assert dict(second.after) == {"n1": 500, "n2": 70}
        assert not second.due({"n1": 499, "n2": 70}) and not second.due({"n1": 500})
        assert second.due({"n1": 500, "n2": 71})
        assert requests.add(["public.c"], only=("lake",)) == 3 and requests.after(2)[0].only == ("lake",)
        assert requests.add(["public.d"], first=True) == 4
        assert requests.after(3) == [Request(4, ["public.d"], first=True)]
        assert not any(r.first for r in requests.after(0)[:3])  # (the column added, older requests unchanged)
