"""Run folders on disk.

Checkpoints (verified, whole or absent) and weights-only exports.
"""
