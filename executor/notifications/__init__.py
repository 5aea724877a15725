"""Telling people an item waits for them, without the engine ever waiting on it."""
