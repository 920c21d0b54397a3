"""The ground floor both halves stand on (stdlib only): errors with hints, the one subprocess wrapper, ports, malloc, version."""
