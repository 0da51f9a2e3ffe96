"""Command lines built on the packages below.

The chat REPL, convert and export.
"""
