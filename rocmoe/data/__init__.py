"""Data for the examples: a byte corpus of the standard library and Criteo-format click logs."""
