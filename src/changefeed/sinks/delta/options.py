"""`--sink delta:///ABS/PATH?mode=...`: where the Delta tables go and how they are written.

`delta:///ABS/PATH` is a local (or mounted) folder; `delta+s3://BUCKET/PREFIX`, `delta+gs://`,
`delta+az://` and `delta+abfss://` name object stores, reached through the Delta library's storage
options, given as `storage.KEY=VALUE` query parameters (e.g. `storage.AWS_REGION=eu-west-1`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from changefeed.errors import ConfigError
from changefeed.sinks.uri_options import Option, boolean, choice, parse_query, whole

MODES = ("changelog", "mirror", "history")
EXAMPLE = "delta:///data/lake?mode=mirror (or delta+s3://BUCKET/PREFIX?storage.AWS_REGION=eu-west-1)"
LEDGER_DIR = "_changefeed"  # under the root: one ledger table per feed
_MOST = 1 << 20  # the largest buckets, tasks or target_file_rows taken


def _check_template(value: str) -> str:
    names = set(re.findall(r"{([^{}]*)}", value))
    if not names <= {"schema", "table"} or "{table}" not in value or value.startswith("/") or ".." in value \
            or value.startswith(LEDGER_DIR):
        raise ConfigError(f"table_template must name {{table}} (and may name {{schema}}) as a relative path, "
                          f"got {value!r}", "e.g. table_template={schema}/{table}")
    return value


def _hint(name: str) -> str:
    return f"e.g. {name}=8"


# the sink's own query options (besides storage.KEY); listed in this order in the hint
_OPTIONS: dict[str, Option] = {
    "mode": Option("mode", choice(*MODES), f"one of {', '.join(MODES)}", label="the Delta sink's mode",
                   hint="changelog (every change a row), mirror (the tables as the source's) or history (every "
                        "version of each row)"),
    "diff": Option("diff", boolean, "true or false", hint=f"e.g. {EXAMPLE}&diff=true"),
    "table_template": Option("table_template", _check_template, "a relative path naming {table}"),
    "buckets": Option("buckets", whole(1, _MOST), "a whole number >= 1"),
    "tasks": Option("tasks", whole(0, _MOST), "a whole number >= 0"),
    "target_file_rows": Option("target_file_rows", whole(1, _MOST), "a whole number >= 1"),
}


@dataclass(frozen=True)
class DeltaOptions:
    root: str  # a local path or an object store URI (s3://...), without a trailing slash
    mode: str = "changelog"
    diff: bool = False  # changelog: a `_before` struct column with the old row
    table_template: str = "{schema}.{table}"
    buckets: int = 16  # mirror/history: key-hash partitions (`_bucket`), each rewritten whole when touched
    tasks: int = 0  # writer tasks per batch; 0: Spark's default parallelism
    target_file_rows: int = 1_000_000  # a data file holds at most this many rows
    storage_given: dict[str, str] = field(default_factory=dict)  # as written: may name secrets by reference

    @property
    def local(self) -> bool:
        return "://" not in self.root

    def table_uri(self, schema: str, table: str) -> str:
        return f"{self.root}/{self.table_template.format(schema=schema, table=table)}"

    def ledger_uri(self, feed: str) -> str:
        return f"{self.root}/{LEDGER_DIR}/{feed}"

    @classmethod
    def parse(cls, uri: str) -> DeltaOptions:
        parts = urlsplit(uri)
        if parts.scheme == "delta":
            if parts.netloc or not parts.path.startswith("/"):
                raise ConfigError(f"a Delta --sink URI names an absolute folder, got {uri!r}",
                                  f"delta:///ABS/PATH (three slashes), e.g. {EXAMPLE}")
            root = unquote(parts.path).rstrip("/") or "/"
        elif parts.scheme.startswith("delta+") and parts.netloc:
            root = f"{parts.scheme[len('delta+'):]}://{parts.netloc}{parts.path}".rstrip("/")
        else:
            raise ConfigError(f"not a Delta --sink URI: {uri!r}", f"e.g. {EXAMPLE}")
        storage: dict[str, str] = {}

        def storage_option(name: str, value: str) -> None:
            """Names not in the table: storage.KEY for the Delta library, or unknown."""
            if not name.startswith("storage."):
                raise ConfigError(f"unknown Delta sink option {name!r}",
                                  f"{', '.join(_OPTIONS)}, storage.KEY; see docs/sinks.md, Delta Lake sink")
            storage[name[len("storage."):]] = value

        given = parse_query(parse_qsl(parts.query, keep_blank_values=True), _OPTIONS, hint=_hint,
                            other=storage_option)
        if given.get("diff") and given.get("mode", "changelog") != "changelog":
            raise ConfigError("diff=true applies to mode=changelog only", "drop diff=true, or use mode=changelog")
        return cls(root, storage_given=storage, **given)

    @property
    def storage(self) -> dict[str, str]:
        """The storage options for the Delta library, references resolved (see secrets.py)."""
        from changefeed.spec.secrets import mapped

        return mapped(self.storage_given, lambda k: f"the --sink option storage.{k}")

