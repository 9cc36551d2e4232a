"""Sinks: where change rows go. One module per sink, registered by URI scheme in `registry`."""
