"""Tests of the `ropekit` subcommands; a package, so basenames may repeat the library tests' names."""
