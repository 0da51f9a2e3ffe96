"""The bottom layer.

What every other package may use (errors, safe unpickling, the run lock).
Imports nothing from src.
"""
