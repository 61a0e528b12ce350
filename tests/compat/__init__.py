"""Tests of ropekit.compat against each peer's own test cases; a package, so basenames may repeat."""
