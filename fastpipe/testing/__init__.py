"""Test and benchmark helpers that ship with fastpipe (its own tests and benchmarks use them; so can a user's
tests): servers on loopback with injected faults. Nothing in fastpipe itself imports this package."""
