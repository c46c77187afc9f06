"""Helpers shared by the store tests and their subprocess entry points."""
