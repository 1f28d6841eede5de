"""Evaluation: benchmark scorers (protocol runners arrive with the evaluation harness)."""
