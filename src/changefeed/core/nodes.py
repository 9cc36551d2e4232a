"""The names of a feed's source nodes.

A feed reads one or more PostgreSQL servers (nodes), each by name. The feed of one node called
`n1` is the classic feed, whose offsets, snapshot entries, progress rows and messages keep the
shapes every feed had before nodes existed; any other feed (several nodes, or one with a name of
its own) takes the path of several nodes throughout.
"""
from __future__ import annotations

from collections.abc import Iterable

DEFAULT_NODE = "n1"


def classic(names: Iterable[str]) -> bool:
    """Whether these node names are the classic one-node feed's."""
    return list(names) == [DEFAULT_NODE]
