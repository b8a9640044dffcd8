"""Ray fixtures: one local cluster per test session, bound to 127.0.0.1."""
