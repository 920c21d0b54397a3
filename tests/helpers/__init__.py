"""Helpers shared by test modules (test modules import these, never each other)."""
