"""Tests of the `ropekit` subcommands (a package, so their basenames may repeat those of the library tests)."""
