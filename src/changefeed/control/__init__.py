"""Running and managing feeds: attach, the run loop, lifecycle commands, status, verify, metrics."""
