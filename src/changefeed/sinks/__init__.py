"""Sinks: where change rows go. One package per sink (`sinks/NAME/`), found by URI scheme in `registry`;
`base` says what a sink is, `batch_input` what its writer tasks receive, `ledger` how far it is."""
