"""Pieces shared by the ops: reading rotated rows from the store (torch) and Triton helpers."""
