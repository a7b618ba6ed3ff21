"""Offline calibration: capture statistics from a transformers model, fit rotations, evaluate INT2."""
